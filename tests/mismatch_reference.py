"""The rollout-mismatch statistics computed independently of megascore: a plain numpy
loop over the sequences of the documented formulas (docs/client.md, "Train/inference
mismatch"), the reference of the engine's and the SDK's statistics in tests."""

from __future__ import annotations

import numpy as np

from megascore.api import mismatch


def numpy_mismatch_stats(scored, rollout, lengths, mask, cap) -> dict[str, np.ndarray]:
    """Statistic name -> float64 ``[B]`` over the tokens of each sequence's loss mask
    (``mask`` None: every token; entry 0 of a sequence never counts; no token: 0.0).

    Args:
        scored: ``[T]`` the scored logprobs, sequences concatenated.
        rollout: ``[T]`` the rollout engine's logprobs, the same layout.
        lengths: ``[B]`` sequence lengths.
        mask: ``[T]`` 0/1 loss mask, or None.
        cap: the ratio cap ``c``.
    """
    stats = {name: [] for name in mismatch.NAMES}
    start = 0
    for n in lengths:
        keep = np.ones(n, bool) if mask is None else mask[start : start + n].astype(bool)
        keep[0] = False
        d = scored[start : start + n].astype(np.float64)[keep] - rollout[start : start + n][keep]
        if d.size == 0:
            values = [0.0] * 5
        else:
            ratio = np.exp(d)
            values = [
                np.abs(d).max(),
                np.abs(d).mean(),
                np.mean(ratio - 1 - d),
                d.mean(),
                np.mean((ratio < 1 / cap) | (ratio > cap)),
            ]
        for name, value in zip(mismatch.NAMES, values, strict=True):
            stats[name].append(value)
        start += n
    return {k: np.array(v) for k, v in stats.items()}

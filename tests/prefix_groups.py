"""Random GRPO-like batches whose sequences share prefixes, for the prefix-sharing tests.

Cases (all in one batch, shuffled so that no group is contiguous): groups of n
continuations of one prompt, with continuations of length 0 (the prompt is a whole
sequence) and 1; a group of n = 1; identical sequences; nested prefixes (a prompt
shared by all, a longer prefix shared by some); a prefix just under the sharing
threshold; sequences sharing nothing; groups of different temperatures.
"""

from __future__ import annotations

import contextlib

import numpy as np

from megascore.api.types import ScoreBatch

VOCAB = 512
MIN_SHARED = 8


def prefix_group_sequences(seed: int) -> tuple[list[np.ndarray], list[float]]:
    """The sequences and their temperatures (see the module docstring)."""
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> np.ndarray:
        return rng.integers(1, VOCAB, n).astype(np.int64)

    seqs: list[np.ndarray] = []
    temps: list[float] = []

    def add(group: list[np.ndarray], temperature: float) -> None:
        seqs.extend(group)
        temps.extend([temperature] * len(group))

    prompt = tokens(int(rng.integers(20, 40)))
    add([np.concatenate([prompt, tokens(n)]) for n in (0, 1, 5, 12, 3)], 1.0)
    add([tokens(30)], 1.0)  # n = 1
    same = tokens(17)
    add([same.copy() for _ in range(3)], 0.8)  # identical sequences
    outer, inner = tokens(24), tokens(20)
    nested = [np.concatenate([outer, inner, tokens(n)]) for n in (4, 0, 9)]
    nested += [np.concatenate([outer, tokens(n)]) for n in (6, 11)]
    add(nested, 1.0)
    short = tokens(MIN_SHARED - 1)  # shared, but shorter than the threshold
    add([np.concatenate([short, tokens(n)]) for n in (5, 7)], 1.0)
    add([np.concatenate([prompt, tokens(4)])], 1.3)  # same prompt, another temperature
    add([tokens(n) for n in (1, 9, 26)], 1.0)
    order = rng.permutation(len(seqs))
    return [seqs[i] for i in order], [temps[i] for i in order]


def prefix_group_batch(seed: int = 0, **fields) -> ScoreBatch:
    """A :class:`ScoreBatch` of :func:`prefix_group_sequences` with a loss mask, top-k and
    losses; ``fields`` override any field."""
    seqs, temps = prefix_group_sequences(seed)
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    rng = np.random.default_rng(seed + 1)
    values = dict(
        token_ids=np.concatenate(seqs),
        lengths=lengths,
        loss_mask=(rng.random(int(lengths.sum())) < 0.8).astype(np.uint8),
        temperature=np.array(temps, dtype=np.float32),
        top_k=4,
        losses=("nll", "mean_nll"),
        return_logprobs=True,
    )
    values.update(fields)
    return ScoreBatch(**values)


def assert_same_scores(shared, dense, atol: float = 1e-6) -> None:
    """Per-token outputs within ``atol``, top-k ids and routes equal, losses close."""
    np.testing.assert_allclose(shared.logprobs, dense.logprobs, rtol=0, atol=atol)
    if dense.top_k_ids is not None:
        np.testing.assert_array_equal(shared.top_k_ids, dense.top_k_ids)
        np.testing.assert_allclose(shared.top_k_logprobs, dense.top_k_logprobs, rtol=0, atol=atol)
    assert shared.losses.keys() == dense.losses.keys()
    for name, values in dense.losses.items():
        np.testing.assert_allclose(shared.losses[name], values, rtol=1e-6, atol=atol)
    np.testing.assert_array_equal(shared.num_loss_tokens, dense.num_loss_tokens)
    if dense.routing is not None:
        np.testing.assert_array_equal(np.sort(shared.routing, -1), np.sort(dense.routing, -1))


def assert_same_metrics(shared, dense, mtp: bool = True) -> None:
    """Every MoE / MTP metric of ``dense`` (it has MoE metrics, and MTP ones with ``mtp``)
    within 1e-6 relative, and the scores as :func:`assert_same_scores`."""
    want = {**dense.moe_metrics, **dense.mtp_metrics}
    got = {**shared.moe_metrics, **shared.mtp_metrics}
    assert dense.moe_metrics and bool(dense.mtp_metrics) == mtp, want
    assert got.keys() == want.keys(), (got, want)
    for name, value in want.items():
        assert abs(got[name] - value) <= 1e-6 * max(abs(value), 1e-3), (name, got[name], value)
    assert_same_scores(shared, dense)


@contextlib.contextmanager
def spy_prefix_attention():
    """Yields a list that gets, per attention plan built on this rank inside the block,
    whether a segment attended to prefix rows."""
    from megascore.model import attention

    seen: list[bool] = []
    build = attention._build_plan

    def spy(seg_lens, cp_rank, cp_size, device, prefixes=None, parents=None):
        seen.append(prefixes is not None and any(len(p) for p in prefixes))
        return build(seg_lens, cp_rank, cp_size, device, prefixes, parents)

    attention._build_plan = spy
    try:
        yield seen
    finally:
        attention._build_plan = build

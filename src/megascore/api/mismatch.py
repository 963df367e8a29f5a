"""Train/inference mismatch: the scored logprobs against a rollout engine's (numpy).

Per sequence, over the tokens of its loss mask (entry 0 of a sequence never counts),
with ``d = scored - rollout`` per token and ``c`` the ratio cap:

* ``max_abs_diff``: ``max |d|``;
* ``mean_abs_diff``: ``mean |d|``;
* ``kl_k3``: ``mean(exp(d) - 1 - d)``, Schulman's k3 estimator of
  KL(rollout || scored) from tokens sampled by the rollout policy
  (``r - 1 - log r`` with ``r = p_scored / p_rollout = exp(d)``; >= 0 per token);
* ``mean_log_ratio``: ``mean d``;
* ``ratio_outside_cap``: the fraction of tokens with ``exp(d)`` outside ``[1/c, c]``
  (``|d| > log c``).

A sequence whose mask holds no token gets 0.0 for every statistic. The per-token
truncated importance weights are ``min(exp(d), c)`` (entry 0 of a sequence 0.0).
Sources: Schulman, "Approximating KL divergence" (2020) for k3; the truncated
importance sampling of Yao et al., "Your efficient RL framework secretly brings you
off-policy RL training" (2025), as in verl's ``rollout_is`` diagnostics.
"""

from __future__ import annotations

import numpy as np

from megascore.api import layout

NAMES = ("max_abs_diff", "mean_abs_diff", "kl_k3", "mean_log_ratio", "ratio_outside_cap")
"""The statistics of :func:`statistics`, in this order."""
DEFAULT_RATIO_CAP = 2.0
"""The ratio cap ``c`` when a request does not set one."""


def log_ratio(scored: np.ndarray, rollout: np.ndarray) -> np.ndarray:
    """float64 ``d = scored - rollout`` per token."""
    return scored.astype(np.float64) - rollout.astype(np.float64)


def k3(d: np.ndarray) -> np.ndarray:
    """Schulman's k3 per token from ``d = log r``: ``exp(d) - 1 - d`` (>= 0)."""
    return np.expm1(d) - d


def masked_mean(values: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """float64 ``[B]``: the mean of ``values`` over each sequence's tokens in ``mask``
    (an effective loss mask; 0.0 for a sequence without one)."""
    count = layout.segment_sum(mask, lengths)
    return layout.segment_sum(np.where(mask > 0, values, 0.0), lengths) / np.maximum(count, 1.0)


def _caps(cap: np.ndarray | None, lengths: np.ndarray) -> np.ndarray:
    """float64 ``[T]``: each token's sequence cap (:data:`DEFAULT_RATIO_CAP` for None)."""
    per_seq = np.full(len(lengths), DEFAULT_RATIO_CAP) if cap is None else cap
    return np.repeat(np.asarray(per_seq, dtype=np.float64), lengths)


def statistics(
    scored: np.ndarray,
    rollout: np.ndarray,
    lengths: np.ndarray,
    loss_mask: np.ndarray | None,
    cap: np.ndarray | None,
) -> dict[str, np.ndarray]:
    """The mismatch statistics of every sequence.

    Args:
        scored: ``[T]`` the scored logprobs (entry 0 of each sequence ignored).
        rollout: ``[T]`` the rollout engine's logprobs of the same tokens.
        lengths: int64 ``[B]``.
        loss_mask: ``[T]`` 0/1, or None for all ones.
        cap: ``[B]`` the ratio cap of each sequence (> 1), or None for the default.

    Returns:
        name (:data:`NAMES`) -> float64 ``[B]``.
    """
    mask = layout.effective_loss_mask(lengths, loss_mask)
    d = np.where(mask > 0, log_ratio(scored, rollout), 0.0)
    log_cap = np.log(_caps(cap, lengths))
    starts = layout.offsets(lengths)[:-1]
    abs_d = np.abs(d)
    return {
        "max_abs_diff": np.maximum.reduceat(abs_d, starts),
        "mean_abs_diff": masked_mean(abs_d, mask, lengths),
        "kl_k3": masked_mean(k3(d), mask, lengths),
        "mean_log_ratio": masked_mean(d, mask, lengths),
        "ratio_outside_cap": masked_mean((abs_d > log_cap) * 1.0, mask, lengths),
    }


def importance_weights(
    scored: np.ndarray, rollout: np.ndarray, lengths: np.ndarray, cap: np.ndarray | None
) -> np.ndarray:
    """float32 ``[T]`` truncated importance weights ``min(exp(scored - rollout), c)``,
    0.0 at entry 0 of each sequence."""
    d = log_ratio(scored, rollout)
    weights = np.minimum(np.exp(np.minimum(d, 80.0)), _caps(cap, lengths))
    weights[layout.offsets(lengths)[:-1]] = 0.0
    return weights.astype(np.float32)

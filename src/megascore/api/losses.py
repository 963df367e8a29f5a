"""Per-sequence losses computed from per-token logprobs (numpy, float64).

A loss is a function of one batch's per-token logprobs in the NeMo-RL layout
(entry 0 of each sequence is 0.0, entry t is ``log p(x_t | x_<t)``), the
effective loss mask (:func:`megascore.api.layout.effective_loss_mask`: the request
mask with entry 0 of every sequence forced to 0) and the sequence lengths; it
returns one float64 value per sequence.

To add a loss, write a function with the :data:`LossFn` signature in this
module and decorate it with ``@register_loss("name")``; it is then listed by
:func:`loss_names` (and so in ``ModelInfo.loss_names``) and accepted in
requests.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from megascore.api.layout import effective_loss_mask, segment_sum

LossFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
"""``fn(logprobs float64 [T], mask float64 [T], lengths int64 [B]) -> float64 [B]``."""

_REGISTRY: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Decorator registering a loss function under ``name``.

    Args:
        name: the loss name clients request.

    Returns:
        The decorator (the function is returned unchanged).
    """

    def decorator(fn: LossFn) -> LossFn:
        if name in _REGISTRY:
            raise ValueError(f"loss {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return decorator


def loss_names() -> tuple[str, ...]:
    """All registered loss names, sorted."""
    return tuple(sorted(_REGISTRY))


@register_loss("nll")
def nll(logprobs: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Summed negative log-likelihood of the masked tokens (0.0 when none)."""
    return 0.0 - segment_sum(logprobs * mask, lengths)  # 0.0 - x: no -0.0 for empty sums


@register_loss("mean_nll")
def mean_nll(logprobs: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per-token mean negative log-likelihood of the masked tokens (0.0 when none)."""
    count = segment_sum(mask, lengths)
    return nll(logprobs, mask, lengths) / np.maximum(count, 1.0)


@register_loss("perplexity")
def perplexity(logprobs: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``exp(mean_nll)`` of the masked tokens (1.0 when none)."""
    return np.exp(mean_nll(logprobs, mask, lengths))


def compute_losses(
    names: tuple[str, ...] | list[str],
    logprobs: np.ndarray,
    lengths: np.ndarray,
    loss_mask: np.ndarray | None,
) -> dict[str, np.ndarray]:
    """Evaluates the named losses for one batch (the tokens that count in them:
    :func:`megascore.api.layout.count_loss_tokens`).

    Args:
        names: loss names (each must be registered).
        logprobs: float32/float64 ``[T]`` per-token logprobs, NeMo-RL layout.
        lengths: int64 ``[B]``, every entry >= 1.
        loss_mask: ``[T]`` of 0/1 or None for all ones.

    Returns:
        name -> float64 ``[B]``.

    Raises:
        ValueError: for an unknown loss name.
    """
    unknown = [n for n in names if n not in _REGISTRY]
    if unknown:
        raise ValueError(f"unknown loss {unknown[0]!r}; known: {list(loss_names())}")
    lengths = np.asarray(lengths, dtype=np.int64)
    mask = effective_loss_mask(lengths, loss_mask)
    lp = np.asarray(logprobs, dtype=np.float64)
    if lp.shape != mask.shape:
        raise ValueError(f"logprobs must have {mask.shape[0]} entries, got {lp.shape}")
    return {name: _REGISTRY[name](lp, mask, lengths).astype(np.float64) for name in names}

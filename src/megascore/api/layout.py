"""The flat token layout of :class:`~megascore.api.types.ScoreBatch` / :class:`ScoreOutput`.

Sequences are concatenated: sequence ``b`` holds tokens
``[offsets[b], offsets[b + 1])`` of every per-token array (``token_ids``,
``loss_mask``, ``logprobs``, top-k rows) and row ``b`` of every per-sequence
array (``lengths``, ``temperature``, losses, ``num_loss_tokens``). Everything
that turns lengths into positions lives here (numpy, torch-free): the engine,
the batcher and the packing use these helpers, never their own prefix sums. Cutting
and joining outputs by sequence is :mod:`megascore.api.selection`.
"""

from __future__ import annotations

import numpy as np


def offsets(lengths: np.ndarray) -> np.ndarray:
    """int64 ``[B+1]`` start of every sequence, then the total.

    Args:
        lengths: ``[B]`` sequence lengths (>= 0).

    Returns:
        ``[0, l0, l0 + l1, ..., sum(lengths)]``.
    """
    out = np.zeros(np.size(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenates ``arange(start, start + length)`` for every run, in order.

    Args:
        starts: ``[R]`` first value of every run.
        lengths: ``[R]`` run lengths (>= 0).

    Returns:
        int64 ``[sum(lengths)]``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    bounds = offsets(lengths)
    within = np.arange(int(bounds[-1]), dtype=np.int64) - np.repeat(bounds[:-1], lengths)
    return np.repeat(np.asarray(starts, dtype=np.int64), lengths) + within


def sequence_at(bounds: np.ndarray, position: int) -> int:
    """Index of the sequence that holds flat token ``position`` (``bounds``: :func:`offsets`)."""
    return int(np.searchsorted(bounds, position, side="right")) - 1


def padded_lengths(lengths: np.ndarray, multiple: int) -> np.ndarray:
    """Each length rounded up to ``multiple`` (int64): what a sequence occupies in a step."""
    lengths = lengths.astype(np.int64, copy=False)
    if multiple == 1:
        return lengths
    return -(-lengths // multiple) * multiple


def token_index(lengths: np.ndarray, seq_idx: np.ndarray) -> np.ndarray | slice:
    """Flat token positions of sequences ``seq_idx`` (concatenated in that order).

    Args:
        lengths: ``[B]`` lengths of the layout the positions refer to.
        seq_idx: int64 indices of the sequences to take.

    Returns:
        A slice when the sequences are consecutive and ascending, else an int64 array.
    """
    bounds = offsets(lengths)
    if seq_idx.size and np.array_equal(seq_idx, np.arange(seq_idx[0], seq_idx[0] + seq_idx.size)):
        return slice(int(bounds[seq_idx[0]]), int(bounds[seq_idx[-1] + 1]))
    return ranges(bounds[seq_idx], lengths[seq_idx])


def segment_sum(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """float64 ``[B]`` sums of ``values [T]`` over each sequence (lengths >= 1)."""
    return np.add.reduceat(values.astype(np.float64), offsets(lengths)[:-1])


def effective_loss_mask(lengths: np.ndarray, loss_mask: np.ndarray | None) -> np.ndarray:
    """The mask losses use: the request mask with entry 0 of each sequence zeroed.

    Args:
        lengths: int64 ``[B]``, every entry >= 1.
        loss_mask: ``[T]`` of 0/1, or None for all ones.

    Returns:
        float64 ``[T]`` of 0.0 / 1.0.
    """
    bounds = offsets(lengths)
    total = int(bounds[-1])
    mask = np.ones(total, np.float64) if loss_mask is None else loss_mask.astype(np.float64)
    if mask.shape != (total,):
        raise ValueError(f"loss_mask must have {total} entries, got {mask.shape}")
    mask[bounds[:-1]] = 0.0
    return mask


def count_loss_tokens(lengths: np.ndarray, loss_mask: np.ndarray | None) -> np.ndarray:
    """int64 ``[B]`` tokens that count in the losses: masked positions 1..L-1."""
    return segment_sum(effective_loss_mask(lengths, loss_mask), lengths).astype(np.int64)

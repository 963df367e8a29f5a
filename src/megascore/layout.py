"""The flat token layout of :class:`~megascore.types.ScoreBatch` / :class:`ScoreOutput`.

Sequences are concatenated: sequence ``b`` holds tokens
``[offsets[b], offsets[b + 1])`` of every per-token array (``token_ids``,
``loss_mask``, ``logprobs``, top-k rows) and row ``b`` of every per-sequence
array (``lengths``, ``temperature``, losses, ``num_loss_tokens``). Everything
that turns lengths into positions lives here (numpy, torch-free): the engine,
the batcher and the packing use these helpers, never their own prefix sums.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from megascore import schema

if TYPE_CHECKING:  # types.py imports this module (ScoreBatch.check): outputs are built as
    from megascore.types import ScoreOutput  # type(output)(...), not through an import

logger = logging.getLogger(__name__)


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


def keep_masked_positions(values: dict, lengths: np.ndarray, loss_mask: np.ndarray | None):
    """``logprob_positions`` "masked": every per-token output of the output head
    (:func:`megascore.schema.positional`) holds its fill outside the loss mask (entry 0
    of each sequence included). Replaces the arrays of ``values`` (never writes into
    them: they may be views of a step's output)."""
    outside = effective_loss_mask(lengths, loss_mask) == 0
    for out in schema.OUTPUTS:
        value = values.get(out.name)
        if value is not None and schema.positional(out):
            value = np.array(value)
            value[outside] = out.fill
            values[out.name] = value


def select_sequences(
    output: ScoreOutput, lengths: np.ndarray, seq_idx: np.ndarray, options
) -> ScoreOutput:
    """Cuts sequences ``seq_idx`` of a step's output, trimmed to one request's options.

    Every output of :data:`megascore.schema.OUTPUTS` the request wants is kept: per-token
    rows of those sequences, per-sequence rows (each the first ``dims(options)`` columns
    of the step's; a map output: the request's keys only).

    Args:
        output: the step's output (layout of ``lengths``).
        lengths: the step's sequence lengths.
        seq_idx: step-sequence indices to take, in the order wanted.
        options: the request's options (its ``ScoreBatch``).

    Returns:
        The output of those sequences only; MoE / MTP metrics are not copied.
    """
    tokens = token_index(lengths, seq_idx)
    values = {}
    for out in schema.OUTPUTS:
        if not out.wanted(options):
            continue
        value = output.values[out.name]
        if out.keys is not None:
            values[out.name] = {key: value[key][seq_idx] for key in out.keys(options)}
            continue
        rows = seq_idx if out.per == schema.SEQUENCE else tokens
        columns = tuple(slice(0, d) for d in schema.flat_dims(out, options))
        values[out.name] = value[(rows, *columns)]
    return type(output)(values=values, weights_version=output.weights_version)


def concat_outputs(parts: list[tuple[np.ndarray, ScoreOutput]], lengths: np.ndarray) -> ScoreOutput:
    """Joins pieces of one request into its own sequence order.

    Args:
        parts: ``(request-sequence indices, output of those sequences)`` per piece;
            together the indices cover every sequence exactly once.
        lengths: the request's lengths.

    Returns:
        The request's output in request order (no MoE / MTP metrics).
    """
    if len(parts) == 1 and np.array_equal(parts[0][0], np.arange(lengths.size)):
        return parts[0][1]
    order = np.concatenate([idx for idx, _ in parts])
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    tokens = token_index(lengths[order], inverse)
    outs = [out for _, out in parts]
    values = {}
    for name, first in outs[0].values.items():
        out = next(o for o in schema.OUTPUTS if o.name == name)
        index = tokens if out.per == schema.TOKEN else inverse
        if out.keys is not None:
            values[name] = {
                k: np.concatenate([o.values[name][k] for o in outs])[index] for k in first
            }
        else:
            values[name] = np.concatenate([o.values[name] for o in outs])[index]
    return type(outs[-1])(values=values, weights_version=outs[-1].weights_version)

"""Outputs cut by sequence and joined back, in the flat token layout of
:mod:`megascore.api.layout`, for every output of the table (:data:`megascore.api.schema.OUTPUTS`).

A step's output is cut into its requests (:func:`select_sequences`), the pieces of one
request are joined in its own order (:func:`concat_outputs`), and ``logprob_positions``
"masked" fills the positions outside the loss mask (:func:`keep_masked_positions`).
"""

from __future__ import annotations

import numpy as np

from megascore.api import schema
from megascore.api.layout import effective_loss_mask, token_index
from megascore.api.types import ScoreOutput


def keep_masked_positions(values: dict, lengths: np.ndarray, loss_mask: np.ndarray | None):
    """``logprob_positions`` "masked": every per-token output of the output head
    (:func:`megascore.api.schema.positional`) holds its fill outside the loss mask (entry 0
    of each sequence included). Replaces the arrays of ``values`` (never writes into
    them: they may be views of a step's output)."""
    fill_positions(values, effective_loss_mask(lengths, loss_mask) == 0)


def fill_positions(values: dict, outside: np.ndarray) -> None:
    """Every per-token output of the output head (:func:`megascore.api.schema.positional`)
    holds its fill where ``outside`` (bool ``[T]``) is set; replaces the arrays of
    ``values``."""
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

    Every output of :data:`megascore.api.schema.OUTPUTS` the request wants is kept: per-token
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
    return ScoreOutput(
        values=values,
        weights_version=output.weights_version,
        reference_weights_version=output.reference_weights_version,
    )


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
    return ScoreOutput(
        values=values,
        weights_version=outs[-1].weights_version,
        reference_weights_version=outs[-1].reference_weights_version,
    )

"""Pure planning for the dynamic batcher: which sequences go into the next step.

A step is filled first-fit decreasing over the *planning units* of the waiting
requests (a sequence, or a request's sequences that share a prompt:
:mod:`megascore_server.shared_units`): the oldest request's costliest remaining
unit goes in first (so the head of the queue always progresses), then every other
candidate unit, costliest first, is taken when it still fits the budget. A request
larger than the budget is therefore spread over several steps, and small requests
fill the room its large units leave.

The budget counts the *padded rows* the engine allocates (each segment rounded up to
its per-sequence pad multiple, :func:`megascore.api.layout.padded_lengths`).
Planning works on domain types only (no protobuf).
"""

from __future__ import annotations

import logging

import numpy as np

from megascore.api import schema
from megascore.api.layout import offsets, ranges, token_index
from megascore.api.types import ScoreBatch

logger = logging.getLogger(__name__)


def fill_step(candidates: list[np.ndarray], budget: int) -> list[np.ndarray]:
    """First-fit decreasing of one step over several requests' planning units.

    Args:
        candidates: per request (oldest first), the rows of its remaining units
            sorted costliest first. ``candidates[0]`` must be non-empty and
            its first entry must fit ``budget``.
        budget: token budget of the step.

    Returns:
        Per request, the positions (into its ``candidates`` entry, ascending) taken
        into the step. The head's position 0 is always taken.
    """
    head_len = int(candidates[0][0])
    if head_len > budget:
        raise ValueError(f"a unit of {head_len} padded rows exceeds the step budget {budget}")
    room = budget - head_len
    sizes = np.array([c.size for c in candidates], dtype=np.int64)
    lens = np.concatenate(candidates)
    owner = np.repeat(np.arange(len(candidates)), sizes)
    pos = ranges(np.zeros(sizes.size, dtype=np.int64), sizes)  # position inside its request
    taken = np.zeros(lens.size, dtype=bool)
    taken[0] = True
    # Longest first; the stable sort keeps older requests first among equal lengths.
    order = np.argsort(-lens, kind="stable")
    while room > 0:
        # Items that still fit, longest first: take the longest prefix that fits,
        # which is exactly what a one-by-one first-fit scan would take next.
        eligible = order[~taken[order] & (lens[order] <= room)]
        if eligible.size == 0:
            break
        cumulative = offsets(lens[eligible])[1:]
        k = int(np.searchsorted(cumulative, room, side="right"))
        taken[eligible[:k]] = True
        room -= int(cumulative[k - 1])
    return [np.sort(pos[taken & (owner == r)]) for r in range(len(candidates))]


def merge_batches(pieces: list[tuple[ScoreBatch, np.ndarray]]) -> ScoreBatch:
    """Builds one engine step from sequences of several requests.

    Driven by :mod:`megascore.api.schema`: each option is combined by its ``merge``
    (the largest top_k, the union of the losses, logprobs / routing when any piece
    wants them, metrics for a piece alone in its step); each input array is taken
    from the pieces that sent it and filled for those that did not (an input without
    a fill, the routing to replay, comes from all pieces or none).

    Args:
        pieces: ``(request batch, request-sequence indices)`` in step order.

    Returns:
        The merged batch.
    """
    tokens = [token_index(batch.lengths, idx) for batch, idx in pieces]
    lengths = [batch.lengths[idx] for batch, idx in pieces]
    merged = {
        "token_ids": np.concatenate(
            [batch.token_ids[at] for (batch, _), at in zip(pieces, tokens, strict=True)]
        ),
        "lengths": np.concatenate(lengths),
    }
    for opt in schema.OPTIONS:
        merged[opt.name] = opt.merge([getattr(batch, opt.name) for batch, _ in pieces])
    for spec in schema.INPUTS:
        given = [getattr(batch, spec.name) is not None for batch, _ in pieces]
        if not any(given):
            merged[spec.name] = None
            continue
        if spec.fill is None and not all(given):
            raise ValueError(f"a step carries the {spec.name} of all its pieces or of none")
        # trailing dims: the widest piece's (narrower ones are padded with the fill)
        values = [getattr(batch, spec.name) for batch, _ in pieces]
        dims = np.max([np.shape(v)[1:] for v in values if v is not None], axis=0).astype(int)
        rows = []
        for value, (_, idx), at, lens in zip(values, pieces, tokens, lengths, strict=True):
            count = int(lens.sum()) if spec.per == schema.TOKEN else lens.size
            row = np.full((count, *dims), spec.fill or 0, spec.dtype)
            if value is not None:
                part = value[at if spec.per == schema.TOKEN else idx]
                row[(slice(None), *(slice(0, n) for n in part.shape[1:]))] = part
            rows.append(row)
        merged[spec.name] = np.concatenate(rows)
    return ScoreBatch(**merged)

"""Pure planning for the dynamic batcher: which sequences go into the next step.

A step is filled first-fit decreasing over the *sequences* of the waiting
requests: the oldest request's longest remaining sequence goes in first (so
the head of the queue always progresses), then every other candidate
sequence, longest first, is taken when it still fits the token budget. A
request larger than the budget is therefore spread over several steps, and
small requests fill the room its long sequences leave.

The budget counts *padded* tokens (each sequence rounded up to the engine's
per-sequence pad multiple, :func:`megascore.layout.padded_lengths`), which is
what the engine allocates. Planning works on domain types only (no protobuf).
"""

from __future__ import annotations

import logging

import numpy as np

from megascore.layout import offsets, ranges, token_index
from megascore.types import ScoreBatch

logger = logging.getLogger(__name__)


def fill_step(candidates: list[np.ndarray], budget: int) -> list[np.ndarray]:
    """First-fit decreasing of one step over several requests' sequences.

    Args:
        candidates: per request (oldest first), the padded lengths of its remaining
            sequences sorted longest first. ``candidates[0]`` must be non-empty and
            its first entry must fit ``budget``.
        budget: token budget of the step.

    Returns:
        Per request, the positions (into its ``candidates`` entry, ascending) taken
        into the step. The head's position 0 is always taken.
    """
    head_len = int(candidates[0][0])
    if head_len > budget:
        raise ValueError(f"sequence of {head_len} padded tokens exceeds the step budget {budget}")
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


def merge_batches(
    pieces: list[tuple[ScoreBatch, np.ndarray]],
    *,
    want_moe_metrics: bool = False,
    want_mtp_metrics: bool = False,
) -> ScoreBatch:
    """Builds one engine step from sequences of several requests.

    Args:
        pieces: ``(request batch, request-sequence indices)`` in step order.
        want_moe_metrics: set for a step holding one MoE-metrics request only.
        want_mtp_metrics: set for a step holding one MTP-metrics request only.

    Returns:
        The merged batch: per-sequence temperatures, the largest top_k of the
        pieces, the union of their losses, logprobs and routing when any piece wants
        them, and the pieces' routings to replay (all pieces replay or none does).
    """
    replays = {b.routing is not None for b, _ in pieces}
    if len(replays) > 1:
        raise ValueError("a step replays the routing of all its pieces or of none")
    ids, lengths, masks, temps, routes = [], [], [], [], []
    any_mask = any(b.loss_mask is not None for b, _ in pieces)
    for batch, idx in pieces:
        tokens = token_index(batch.lengths, idx)
        ids.append(batch.token_ids[tokens])
        lens = batch.lengths[idx]
        lengths.append(lens)
        temps.append(batch.temperatures()[idx])
        if batch.routing is not None:
            routes.append(batch.routing[tokens])
        if any_mask:
            if batch.loss_mask is None:
                masks.append(np.ones(int(lens.sum()), dtype=np.uint8))
            else:
                masks.append(batch.loss_mask[tokens])
    losses: dict[str, None] = {}
    for batch, _ in pieces:
        losses.update(dict.fromkeys(batch.losses))
    return ScoreBatch(
        token_ids=np.concatenate(ids),
        lengths=np.concatenate(lengths),
        loss_mask=np.concatenate(masks) if any_mask else None,
        temperature=np.concatenate(temps).astype(np.float32, copy=False),
        top_k=max(b.top_k for b, _ in pieces),
        losses=tuple(losses),
        want_logprobs=any(b.want_logprobs for b, _ in pieces),
        want_moe_metrics=want_moe_metrics,
        want_mtp_metrics=want_mtp_metrics,
        want_routing=any(b.want_routing for b, _ in pieces),
        routing=np.concatenate(routes) if routes else None,
    )

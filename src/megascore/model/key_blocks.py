"""The key-block attention's plan (:class:`megascore.model.attention.TorchCoreAttention`
with ``key_block`` > 0): query blocks aligned at the start of their sequences, each
attending causally to its own rows, then to every key before it.

Every segment's rows are cut into query blocks of ``block`` positions aligned at the start
of its sequence (its offset, the positions before its first row, is a multiple of
``block``: a cached prefix or a shared parent). A block attends causally to its own rows
(one call for all the blocks of one length), then to every key before it (the segment's
prefix rows and its own earlier rows: one call per query length and key count), merged by
the two log-sum-exps (:func:`megascore.model.sdpa.merge_ordered`). A query's numbers then
depend only on its block's position and the keys: the same bits whether its sequence was
computed whole, after a cached prefix (``megascore.engine.cache``) or after a prefix shared
in its step, whatever else is in the step (batch-invariant mode: docs/engine.md "Prefix
cache").
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class BlockCall:
    """Key-block attention (:func:`build_blocked_plan`): ``n`` query blocks of ``q_len``
    rows against ``k_len`` keys each, without a mask (every key precedes every query) or
    causally over the block's own rows (``causal``, ``k_len == q_len``).

    Attributes:
        q_index: ``[n, q_len]`` local rows of the queries.
        k_index: ``[n, k_len]`` rows of the keys on the key axis (packed, then cached).
        causal: the block's own rows (written first); else the keys before the block,
            merged into them by their log-sum-exps.
        q_rows, k_rows: the same rows as a slice when they are consecutive.
    """

    q_index: torch.Tensor
    k_index: torch.Tensor
    causal: bool
    q_rows: slice | None = None
    k_rows: slice | None = None



def build_blocked_plan(
    seg_lens: list[int],
    block: int,
    device: torch.device,
    prefixes: list[torch.Tensor] | None = None,
    offsets: tuple[int, ...] | None = None,
) -> tuple[BlockCall, ...]:
    """The calls of one CP rank's segments (CP 1: the module docstring).

    Args:
        seg_lens: padded length of every segment, in packing order.
        block: the query / key block (rows).
        device: where the index tensors live.
        prefixes: per segment, the rows on the key axis of the positions before its
            first one (:func:`megascore.engine.layout.segment_packing.prefix_rows`), or None.
        offsets: per segment, the position of its first row (a multiple of ``block``).

    Returns:
        The causal calls first, then the calls over the keys before the blocks.
    """
    causal: dict[int, list[torch.Tensor]] = {}  # q_len -> [query rows]
    before: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    start = 0
    for s, length in enumerate(seg_lens):
        offset = offsets[s] if offsets is not None else 0
        if offset % block:
            raise ValueError(f"segment {s}: offset {offset} is not a multiple of {block}")
        prefix = prefixes[s] if prefixes is not None else torch.empty(0, dtype=torch.long)
        own = torch.arange(start, start + length)
        keys = torch.cat([prefix, own])  # key axis rows of positions 0 .. offset + length
        for first in range(0, length, block):
            rows = own[first : first + block]
            causal.setdefault(len(rows), []).append(rows)
            if offset + first:
                before.setdefault((len(rows), offset + first), []).append(
                    (rows, keys[: offset + first])
                )
        start += length
    calls = [
        BlockCall(causal=True, **indices(torch.stack(rows), torch.stack(rows), device))
        for _, rows in sorted(causal.items())
    ]
    for _, entries in sorted(before.items()):
        q_index = torch.stack([rows for rows, _ in entries])
        k_index = torch.stack([keys for _, keys in entries])
        calls.append(BlockCall(causal=False, **indices(q_index, k_index, device)))
    return tuple(calls)



def indices(q_index: torch.Tensor, k_index: torch.Tensor, device) -> dict:
    """A call's query and key indices (on the CPU) as its fields: on ``device``, and as
    slices where the rows are consecutive."""
    return dict(
        q_index=q_index.to(device),
        k_index=k_index.to(device),
        q_rows=_consecutive(q_index),
        k_rows=_consecutive(k_index),
    )


def _consecutive(index: torch.Tensor) -> slice | None:
    """``index`` (any shape, on the CPU) as the slice of rows it lists in order, or None
    when they are not consecutive."""
    flat = index.reshape(-1)
    if not len(flat):
        return None
    start = int(flat[0])
    if not torch.equal(flat, torch.arange(start, start + len(flat))):
        return None
    return slice(start, start + len(flat))



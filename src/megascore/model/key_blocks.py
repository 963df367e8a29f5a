"""The key-block attention (:class:`megascore.model.attention.TorchCoreAttention` with
``key_block`` > 0): query blocks aligned at the start of their sequences, each attending
causally to its own rows, then to every key before it.

Every segment's rows are cut into query blocks of ``block`` positions aligned at the start
of its sequence (its offset, the positions before its first row, is a multiple of
``block``: a cached prefix or a shared parent). A block attends causally to its own rows
(one call for all the full blocks of a segment, one for its last, shorter block), then
to every key before it (one call per block: ``block`` queries against ``offset + i``
keys), and the two are merged by their log-sum-exps (:func:`megascore.model.sdpa.
merge_ordered`, once over every row; a first block has no keys before it: weight 0). A
query's numbers then depend only on its block's position and the keys: the same bits
whether its sequence was computed whole, after a cached prefix
(``megascore.engine.cache``) or after a prefix shared in its step, whatever else is in the
step (batch-invariant mode: docs/engine.md "Prefix cache").

Every call reads views: a segment's queries, and its keys when they follow each other
(a sequence computed whole); a segment with a prefix gathers its keys once per layer,
prefix then own rows, and every block reads a view of that (an earlier version batched
the blocks of all segments by shape and gathered each block's keys: ``L^2 / block`` rows
per sequence and layer, 3x the attention's time on ``bench``).
"""

from __future__ import annotations

import dataclasses

import torch

from megascore.model.sdpa import attention_with_lse, merge_ordered


@dataclasses.dataclass(frozen=True)
class KeySegment:
    """One segment of the key-block attention.

    Attributes:
        rows: its rows (queries, outputs) in the packed tensor.
        offset: the positions before its first row (a multiple of the block).
        keys: its keys on the key axis (prefix, then own rows): a slice when they
            follow each other, else an int64 index.
    """

    rows: slice
    offset: int
    keys: slice | torch.Tensor


def plan_segments(
    seg_lens: list[int],
    block: int,
    device: torch.device,
    prefixes: list[torch.Tensor] | None = None,
    offsets: tuple[int, ...] | None = None,
) -> tuple[KeySegment, ...]:
    """The segments of one (CP 1) packed tensor.

    Args:
        seg_lens: padded length of every segment, in packing order.
        block: the query / key block (rows).
        device: where the index tensors live.
        prefixes: per segment, the rows on the key axis of the positions before its
            first one (:func:`megascore.engine.layout.segment_packing.prefix_rows`), or None.
        offsets: per segment, the position of its first row (a multiple of ``block``).
    """
    out, start = [], 0
    for s, length in enumerate(seg_lens):
        offset = offsets[s] if offsets is not None else 0
        if offset % block:
            raise ValueError(f"segment {s}: offset {offset} is not a multiple of {block}")
        if length:
            keys: slice | torch.Tensor = slice(start, start + length)
            if offset:
                own = torch.arange(start, start + length)
                keys = torch.cat([prefixes[s], own]).to(device)
            out.append(KeySegment(slice(start, start + length), offset, keys))
        start += length
    return tuple(out)


def attend(q, k, v, segments: tuple[KeySegment, ...], block: int, scale: float) -> torch.Tensor:
    """The key-block attention of every segment (module docstring).

    Args:
        q: ``[t, heads, dim]``; k: ``[t_k, groups, dim]``; v: ``[t_k, groups, v_dim]``.
        segments: :func:`plan_segments`.
        block: the query / key block.
        scale: the softmax scale.

    Returns:
        ``[t, heads, v_dim]``.
    """
    t, heads = q.shape[:2]
    own_out = q.new_zeros(t, heads, v.shape[-1])
    own_lse = q.new_zeros(t, heads, dtype=torch.float32)
    before_out = torch.zeros_like(own_out)
    before_lse = torch.full_like(own_lse, float("-inf"))  # weight 0: no keys before
    for seg in segments:
        qs = q[seg.rows]
        ks, vs = k[seg.keys], v[seg.keys]  # prefix, then own rows
        n = qs.shape[0]
        full = n // block * block
        for first, end in ((0, full), (full, n)):  # the full blocks, then the last one
            if end > first:
                rows = slice(seg.rows.start + first, seg.rows.start + end)
                own = slice(seg.offset + first, seg.offset + end)
                size = min(block, end - first)
                o, lse = attention_with_lse(
                    _blocks(qs[first:end], size),
                    _blocks(ks[own], size),
                    _blocks(vs[own], size),
                    causal=True,
                    mask=None,
                    scale=scale,
                )
                own_out[rows] = o.permute(0, 2, 1, 3).reshape(end - first, heads, -1)
                own_lse[rows] = lse.permute(0, 2, 1).reshape(end - first, heads)
        for first in range(0, n, block):
            keys = seg.offset + first
            if not keys:
                continue
            rows = slice(seg.rows.start + first, seg.rows.start + min(first + block, n))
            o, lse = attention_with_lse(
                q[rows].permute(1, 0, 2)[None],
                ks[:keys].permute(1, 0, 2)[None],
                vs[:keys].permute(1, 0, 2)[None],
                causal=False,
                mask=None,
                scale=scale,
            )
            before_out[rows] = o[0].permute(1, 0, 2)
            before_lse[rows] = lse[0].permute(1, 0)
    return merge_ordered(before_out, before_lse, own_out, own_lse).to(q.dtype)


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """``[m * size, g, d]`` rows as ``m`` blocks ``[m, g, size, d]`` (a view)."""
    return x.reshape(-1, size, *x.shape[1:]).permute(0, 2, 1, 3)

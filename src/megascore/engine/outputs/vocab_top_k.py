"""Exact top-k over a tensor-parallel-sharded vocabulary, one chunk of rows at a time.

A two-stage selection: each rank takes its shard's top-k (ties at the k-th value go
to the lowest id, so the choice does not depend on how the vocabulary is split), the
TP group all-gathers the ``k`` candidates of every rank, and a stable sort keeps the
k largest (equal values in ascending id order). Used by
:class:`megascore.engine.outputs.logprobs.ChunkScores`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

TIE_BLOCK_ROWS = 64
"""Rows per block of the exact pass over tied rows: its temporaries are a few
``[64, V/tp]`` tensors (~100 MB at a 128k vocabulary), whatever the chunk size."""


def _boundary_ties(
    values: torch.Tensor, rows: torch.Tensor, kth: torch.Tensor, k: int
) -> torch.Tensor:
    """Top-k ids of the ``rows`` of ``values`` whose k-th and (k+1)-th largest are equal.

    Every column above the k-th value, then the lowest-id columns equal to it: one
    top-k over an int32 key per block of rows, the column's class (2 above the k-th
    value, 1 equal, 0 below) times V plus ``V - 1 - column`` (lower ids rank higher
    within a class). Fewer than k columns are above, at least k are at or above, and
    the keys are distinct, so the k largest keys are that set, with no host sync.

    Args:
        values: float32 ``[C, V]``.
        rows: int64 ``[A]``, the tied rows.
        kth: ``[A]``, the k-th largest value of each of those rows.
        k: ``1 <= k < V``.

    Returns:
        int64 ``[A, k]`` column ids (in no particular order).
    """
    num_cols = values.shape[1]
    # V - 1 - column: [V]
    lower_first = torch.arange(num_cols - 1, -1, -1, dtype=torch.int32, device=values.device)
    blocks = []
    for start in range(0, rows.numel(), TIE_BLOCK_ROWS):
        block = values.index_select(0, rows[start : start + TIE_BLOCK_ROWS])  # [b, V]
        edge = kth[start : start + TIE_BLOCK_ROWS, None]  # [b, 1]
        key = (block > edge).to(torch.int32).add_(block >= edge)  # class: [b, V]
        del block
        key.mul_(num_cols).add_(lower_first)
        blocks.append(torch.topk(key, k, dim=-1, sorted=False).indices)
    return torch.cat(blocks)


def _local_top_k_lowest_id(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each row where ties at the k-th value go to the lowest column.

    ``torch.topk`` picks an arbitrary subset of equal values at the boundary
    (common with bf16 logits); this makes the choice deterministic and
    independent of how the vocabulary is split across TP ranks. One
    ``topk(k + 1)`` settles every row whose k-th and (k+1)-th values differ (the
    top-k set is then unique); only the rows with a tie at the boundary take the
    exact pass of :func:`_boundary_ties`, in blocks of ``TIE_BLOCK_ROWS`` rows.

    Args:
        values: float32 ``[C, V]``.
        k: ``1 <= k <= V``.

    Returns:
        ``(ids [C, k] int64, values [C, k])``, ids in ascending order (not by value).
    """
    num_rows, num_cols = values.shape
    if num_rows == 0 or k == num_cols:
        ids = torch.arange(k, device=values.device).expand(num_rows, k).contiguous()
        return ids, torch.gather(values, -1, ids)
    top = torch.topk(values, k + 1, dim=-1, sorted=True)
    ids = top.indices[:, :k]
    # rows where the k-th and (k+1)-th values are equal: which of them belong is ambiguous;
    # the chunk's one host sync (the count sizes the exact pass over those rows only)
    ambiguous = (top.values[:, k - 1] == top.values[:, k]).nonzero().squeeze(1)
    if ambiguous.numel():
        ids[ambiguous] = _boundary_ties(values, ambiguous, top.values[ambiguous, k - 1], k)
    ids = ids.sort(dim=-1).values
    return ids, torch.gather(values, -1, ids)


def chunk_top_k(
    logits: torch.Tensor,
    k: int,
    vocab_start: int,
    vocab_size: int | None,
    tp_group: dist.ProcessGroup | None,
    tp_size: int,
    work: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distributed top-k of one chunk of logits.

    Selecting on the logits rather than the log-probabilities gives the same ids:
    the two differ by one constant per row (the log normaliser).

    Args:
        logits: float32 ``[C, V_local]`` (already divided by the temperature).
        k: number of alternatives.
        vocab_start: global id of this shard's column 0.
        vocab_size: ids >= vocab_size (Megatron vocabulary padding) are never chosen;
            None keeps every column.
        tp_group: tensor-parallel group, or None.
        tp_size: size of ``tp_group``.
        work: float32 scratch of at least ``[C, V_local]``, overwritten when this shard
            holds padding columns.

    Returns:
        ``(ids [C, k] int64, logits [C, k] float32)``, largest first; equal values
        are ordered by ascending id (for any TP split).
    """
    num_tokens, v_local = logits.shape
    if vocab_size is not None and vocab_start + v_local > vocab_size:
        logits = work[:num_tokens].copy_(logits)
        logits[:, max(vocab_size - vocab_start, 0) :] = float("-inf")
    k_local = min(k, v_local)
    cand_ids, cand_vals = _local_top_k_lowest_id(logits, k_local)
    cand_ids = cand_ids + vocab_start
    if tp_size > 1:
        gathered_vals = [torch.empty_like(cand_vals) for _ in range(tp_size)]
        gathered_ids = [torch.empty_like(cand_ids) for _ in range(tp_size)]
        dist.all_gather(gathered_vals, cand_vals.contiguous(), group=tp_group)
        dist.all_gather(gathered_ids, cand_ids.contiguous(), group=tp_group)
        # [C, tp * k_local]; ids ascend along the row (shards are in rank order)
        cand_vals = torch.cat(gathered_vals, dim=-1)
        cand_ids = torch.cat(gathered_ids, dim=-1)
    # Stable descending sort keeps equal values in ascending id order.
    val_order = torch.sort(cand_vals, dim=-1, descending=True, stable=True).indices[:, :k]
    assert val_order.shape == (num_tokens, k)
    return torch.gather(cand_ids, -1, val_order), torch.gather(cand_vals, -1, val_order)

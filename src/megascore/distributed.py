"""Collective helpers: generic tensor broadcast and the inverse of CP sharding.

Every function takes its process group explicitly; none falls back to the
default group. They work with gloo (CPU tensors) and NCCL (tensors on the
current CUDA device).

Both functions keep the ranks in step even when they raise: a rank that finds
a problem still takes part in every collective of the call, then raises, so the
other ranks never hang in a collective nobody else entered.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megascore.packing import cp_shard_indices

logger = logging.getLogger(__name__)


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """The device a collective on ``group`` needs its tensors on.

    Args:
        group: the process group.

    Returns:
        The current CUDA device for NCCL, the CPU otherwise.
    """
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_tensor(
    tensor: torch.Tensor | None, src_rank: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """Broadcasts a tensor of any shape/dtype from ``src_rank`` to every rank of ``group``.

    Shape and dtype travel first (``broadcast_object_list``), then the tensor.
    Non-source ranks may pass None (a buffer is allocated) or a buffer of the
    right shape and dtype (it is filled in place and returned).

    Args:
        tensor: the data on the source rank; None or a receive buffer elsewhere.
        src_rank: *global* rank of the source (as ``torch.distributed.broadcast``).
        group: the process group (required).

    Returns:
        The broadcast tensor: on the source the input itself, elsewhere the filled
        buffer (on the collective device when allocated here).

    Raises:
        ValueError: the source passed None (raised on every rank), or this rank's
            buffer has the wrong shape/dtype (raised on that rank, after the
            broadcast so that the others are not left waiting).
    """
    device = collective_device(group)
    is_src = dist.get_rank() == src_rank
    meta: list[object] = [None]
    if is_src and tensor is not None:
        meta = [(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))]
    dist.broadcast_object_list(meta, src=src_rank, group=group, device=device)
    if meta[0] is None:
        raise ValueError(f"broadcast_tensor: the source rank {src_rank} passed None")
    shape, dtype_name = meta[0]
    dtype = getattr(torch, dtype_name)

    if is_src:
        send = tensor.to(device).contiguous()
        dist.broadcast(send, src=src_rank, group=group)
        return tensor

    mismatch = tensor is not None and (tuple(tensor.shape) != shape or tensor.dtype != dtype)
    direct = (
        tensor is not None and not mismatch and tensor.device == device and tensor.is_contiguous()
    )
    recv = tensor if direct else torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(recv, src=src_rank, group=group)
    if mismatch:
        raise ValueError(
            f"broadcast_tensor: buffer on rank {dist.get_rank()} is "
            f"{tuple(tensor.shape)} {tensor.dtype}, the source sent {shape} {dtype}"
        )
    if tensor is None or direct:
        return recv
    tensor.copy_(recv)
    return tensor


def gather_cp_shards(
    local: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_group: dist.ProcessGroup
) -> torch.Tensor:
    """Reassembles CP-sharded per-token values into the full packed order.

    The inverse of the sharding of :func:`megascore.packing.pack_sequences`: rank
    ``r`` of ``cp_group`` holds the tokens at ``cp_shard_indices(cu, r, cp_size)``.

    Args:
        local: ``[1, T / cp_size, ...]`` this rank's shard.
        cu_seqlens_padded: ``[B+1]`` padded boundaries of the full packed axis.
        cp_group: the context-parallel group (required; its ranks are the CP ranks).

    Returns:
        ``[1, T, ...]`` full tensor in natural packed order, identical on every rank
        of ``cp_group``; ``local`` itself when the group has one rank.

    Raises:
        ValueError: ``local`` does not have ``T / cp_size`` tokens (raised before
            any collective, so every rank of a consistent call raises alike).
    """
    cp_size = dist.get_world_size(cp_group)
    if cp_size == 1:
        return local
    total = int(cu_seqlens_padded[-1])
    if local.dim() < 2 or local.shape[0] != 1 or local.shape[1] * cp_size != total:
        raise ValueError(
            f"gather_cp_shards: local shard {tuple(local.shape)} is not "
            f"[1, {total} / {cp_size}, ...]"
        )
    local = local.contiguous()
    shards = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(shards, local, group=cp_group)
    full = local.new_empty((1, total, *local.shape[2:]))
    for rank, shard in enumerate(shards):
        idx = cp_shard_indices(cu_seqlens_padded, rank, cp_size).to(local.device)
        full[:, idx] = shard
    return full

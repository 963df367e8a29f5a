"""Collective helpers: the collective device and the inverse of CP sharding.

Every function takes its process group explicitly; none falls back to the
default group. They work with gloo (CPU tensors) and NCCL (tensors on the
current CUDA device).

:func:`gather_cp_shards` keeps the ranks in step even when it raises: it checks
the shard before any collective, and every rank finds the same problem, so no
rank hangs in a collective nobody else entered.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megascore.engine.layout.packing import cp_shard_indices


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


def gather_cp_shards(
    local: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_group: dist.ProcessGroup
) -> torch.Tensor:
    """Reassembles CP-sharded per-token values into the full packed order.

    The inverse of the sharding of :func:`megascore.engine.layout.packing.pack_sequences`: rank
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

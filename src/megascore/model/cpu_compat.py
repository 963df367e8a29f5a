"""Compatibility measures that let Megatron-Core run its real GPTModel code path on the CPU.

Megatron-Core 0.19 assumes CUDA in a few places that are not about the maths.
On a CPU-only host (a CUDA build of torch without a driver, gloo collectives)
these are the only changes megascore makes; everything else is Megatron's own
code (layers, mappings, router, dispatcher, MTP):

* ``torch.cuda.current_device()`` is called to place buffers (tensor-parallel
  mappings, MoE router buffers, MTP trackers, rotary embeddings ...). On the CPU
  it raises ("no NVIDIA driver"); :func:`apply` makes it return the CPU device.
* ``torch.cuda.synchronize()`` is called by Megatron's distributed-checkpoint
  writer after staging tensors to the host; on the CPU :func:`apply` makes it a
  no-op (there is no device work to wait for).
* ``model_parallel_cuda_manual_seed`` needs CUDA generators. On the CPU the torch
  CPU generator is seeded instead and Megatron's RNG tracker is the inference
  tracker whose ``fork()`` is a no-op context: scoring runs with dropout off and
  megascore initialises weights itself (``megascore.model.build``), so no code
  path draws from a forked CUDA generator.
* Pipeline parallelism: a last stage holding a copy of the word embedding (tied
  output layer, or MTP) moves it with ``.cuda()`` before all-reducing it with the
  first stage: :func:`apply` makes ``Tensor.cuda()`` return the tensor itself.
  Megatron's schedules (``get_forward_backward_func``) allocate their token
  counter with ``torch.zeros(..., device="cuda")``: :func:`apply` makes
  ``torch.zeros`` place a ``"cuda"`` request on the CPU. (A ``TorchFunctionMode``
  around the schedule would do the same but taxes every op of the forward: +46 %
  on a tiny model.) The p2p sends work on gloo as they are (gloo has no
  coalescing: ``batch_isend_irecv`` issues the isend / irecv one by one).
* ``get_pos_emb_on_this_cp_rank`` (RoPE tables of an unpacked sequence under context
  parallelism) builds its index tensor in pinned memory and copies it to CUDA; YaRN's
  rotary embedding (multi-latent attention) calls it once at construction to fill its
  cache. :func:`apply` points the modules that imported it at
  :func:`_cpu_pos_emb_on_this_cp_rank`, the same selection on the tensor's own device.
* The alltoall token dispatcher and shared-expert overlap create CUDA streams:
  :func:`transformer_config_overrides` selects the ``allgather`` dispatcher and
  turns overlap and fused kernels off.
* The local ``DotProductAttention`` supports neither packed THD input nor
  context parallelism; ``megascore.model.attention.TorchCoreAttention`` replaces
  it through the layer spec (that is a backend, not a patch, so it lives there).

Everything here is applied only when the model runs on the CPU. On a host that has
CUDA but serves on the CPU (``--device cpu``) :func:`apply` makes the CPU this process's
*current* device and nothing more: ``torch.cuda.current_device()``, ``Tensor.cuda()``
without a device and ``torch.zeros(device="cuda")`` mean the CPU, while explicitly
indexed CUDA devices (``"cuda:0"``, ``.cuda(0)``) and ``torch.cuda.synchronize`` keep
their real behaviour. A GPU model never calls :func:`apply`, so its CUDA code paths are
untouched.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_APPLIED = False


def _cpu_current_device() -> torch.device:
    """Stand-in for ``torch.cuda.current_device`` on a CPU-only host.

    Returns:
        The CPU device, usable wherever Megatron passes ``device=current_device()``.
    """
    return torch.device("cpu")


def _cpu_synchronize(device: Any = None) -> None:
    """Stand-in for ``torch.cuda.synchronize`` on a CPU-only host: nothing to wait for."""


_ORIGINAL: dict[str, Any] = {}
"""What :func:`apply` replaced (``Tensor.cuda``, ``torch.zeros``), for the calls it passes on."""


def _means_current_device(device: Any, cuda_host: bool) -> bool:
    """Whether a device request means this process's current device (the CPU): None (as
    in ``Tensor.cuda()``), any CUDA device on a CPU-only host, an unindexed ``"cuda"`` on
    a CUDA host."""
    if device is None:
        return True
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return device.type == "cuda" and (not cuda_host or device.index is None)


def _cpu_tensor_cuda(self: torch.Tensor, device: Any = None, *args: Any, **kwargs: Any):
    """``Tensor.cuda`` when the CPU is the current device: the tensor stays where it is
    (an explicitly indexed device on a CUDA host still moves it)."""
    if _means_current_device(device, _ORIGINAL["cuda_host"]):
        return self
    return _ORIGINAL["Tensor.cuda"](self, device, *args, **kwargs)


def _cpu_zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.zeros`` when the CPU is the current device: a ``device="cuda"`` request
    lands on the CPU (an explicitly indexed device on a CUDA host does not)."""
    device = kwargs.get("device")
    if device is not None and _means_current_device(device, _ORIGINAL["cuda_host"]):
        kwargs["device"] = "cpu"
    return _ORIGINAL["torch.zeros"](*args, **kwargs)


def _cpu_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Megatron's ``get_pos_emb_on_this_cp_rank`` without the CUDA copy: the chunks
    ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size`` along ``seq_dim``."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    shape = pos_emb.shape
    pos_emb = pos_emb.view(*shape[:seq_dim], 2 * cp_size, -1, *shape[seq_dim + 1 :])
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])


def apply() -> None:
    """Applies the process-wide CPU measures (idempotent, thread-safe).

    Call it before building a Megatron model on the CPU. On a host with CUDA it makes
    the CPU the current device only (module docstring): explicitly indexed CUDA devices
    and ``torch.cuda.synchronize`` keep working.
    """
    global _APPLIED
    with _LOCK:
        if _APPLIED:
            return
        cuda_host = torch.cuda.is_available()
        _ORIGINAL.update(
            {"cuda_host": cuda_host, "Tensor.cuda": torch.Tensor.cuda, "torch.zeros": torch.zeros}
        )
        torch.cuda.current_device = _cpu_current_device
        if not cuda_host:  # a CUDA host's synchronize works (and waits for nothing here)
            torch.cuda.synchronize = _cpu_synchronize
        torch.Tensor.cuda = _cpu_tensor_cuda
        torch.zeros = _cpu_zeros
        from megatron.core.models.common.embeddings import (
            rope_utils,
            rotary_pos_embedding,
            yarn_rotary_pos_embedding,
        )

        for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
            module.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank
        _APPLIED = True
        logger.info(
            "megatron CPU compatibility applied%s: torch.cuda.current_device -> cpu, "
            "torch.cuda.synchronize -> %s, Tensor.cuda() -> the tensor itself, "
            'torch.zeros(device="cuda") -> cpu, get_pos_emb_on_this_cp_rank on the CPU',
            " on a CUDA host (the model runs on the CPU)" if cuda_host else "",
            "unchanged" if cuda_host else "no-op",
        )


def seed_rng(seed: int) -> None:
    """Seeds the CPU generator and installs a no-op Megatron RNG tracker (CPU replacement
    for ``model_parallel_cuda_manual_seed``).

    Args:
        seed: the seed; every rank passes the same value.
    """
    from megatron.core.tensor_parallel import random as mcore_random

    torch.manual_seed(seed)
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def transformer_config_overrides() -> dict[str, Any]:
    """``TransformerConfig`` fields that must take these values on the CPU.

    Returns:
        Field name -> value: the allgather MoE dispatcher, no shared-expert overlap,
        no fused kernels (they are CUDA/TE-only), CPU parameter allocation.
    """
    return {
        "moe_token_dispatcher_type": "allgather",
        "moe_shared_expert_overlap": False,
        "moe_router_fusion": False,
        "moe_permute_fusion": False,
        "moe_grouped_gemm": False,
        "apply_rope_fusion": False,
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
        "use_cpu_initialization": True,
    }

"""Layout-independent deterministic weights and full-tensor sharding.

Built-in models get random weights that depend only on the seed and the
parameter's *canonical* name (its name in a TP=EP=PP=1 "torch"-backend model), so
every parallel layout and both attention backends build the same function:
each parameter's full tensor is drawn from its own generator, then this rank's
shard is cut out of it exactly as Megatron shards (``partition_dim``, stride,
expert index ``ep_rank * num_local_experts + i``).

:func:`shard_full_tensor` is also what a checkpoint loader needs to place a full
(unsharded) tensor into a local parameter.
"""

from __future__ import annotations

import logging
import math
import re
import zlib

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

logger = logging.getLogger(__name__)

_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_DECODER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
# TE fuses the pre-attention / pre-MLP norms into the following linear layer.
_TE_FUSED_NORMS = (
    ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
    ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside wrappers (``.module`` chains), or ``model`` itself."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def decoder_layer_offset(model: torch.nn.Module) -> int:
    """Global index of this pipeline stage's first decoder layer (0 without PP)."""
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    if layers is None or len(layers) == 0:
        return 0
    return int(getattr(layers[0], "layer_number", 1)) - 1


def canonical_name(
    name: str,
    *,
    ep_rank: int,
    num_local_experts: int,
    layer_offset: int = 0,
    tied_output: bool = False,
) -> str:
    """Name of a parameter in the unsharded, single-stage "torch"-backend model.

    Args:
        name: local parameter name (``model.named_parameters()``).
        ep_rank: this rank's index in the expert-parallel group.
        num_local_experts: experts held by this rank.
        layer_offset: global index of this pipeline stage's first decoder layer.
        tied_output: embeddings and output layer share weights: the last pipeline
            stage's own copy of the output weight is the word embedding.

    Returns:
        The name with global layer and expert indices and unfused norm names.
    """
    for te_name, local_name in _TE_FUSED_NORMS:
        name = name.replace(te_name, local_name)
    if layer_offset:
        name = _DECODER_LAYER.sub(
            lambda m: f"decoder.layers.{layer_offset + int(m.group(1))}.", name
        )
    if tied_output and name == "output_layer.weight":
        name = "embedding.word_embeddings.weight"
    return _LOCAL_EXPERT.sub(
        lambda m: f".local_experts.{ep_rank * num_local_experts + int(m.group(1))}.", name
    )


def _is_expert(param: torch.nn.Parameter) -> bool:
    return not getattr(param, "allreduce", True)


def shard_layout(
    name: str, param: torch.nn.Parameter, pg_collection: ProcessGroupCollection, glu: bool
) -> tuple[int | None, int, int, int]:
    """How ``param`` is cut out of its full tensor.

    Args:
        name: parameter name.
        param: the local parameter (Megatron's TP attributes are read).
        pg_collection: the model's process groups (``tp`` and ``expt_tp``).
        glu: whether the MLP is gated (fc1 then holds ``[gate_r; up_r]`` per rank).

    Returns:
        ``(partition_dim or None, stride, rank, world_size)`` in the relevant TP group.
    """
    if not getattr(param, "tensor_model_parallel", False):
        return None, 1, 0, 1
    group = pg_collection.expt_tp if _is_expert(param) else pg_collection.tp
    size = 1 if group is None else group.size()
    rank = 0 if group is None else group.rank()
    stride = getattr(param, "partition_stride", 1)
    if glu and re.search(r"linear_fc1\.(weight|bias)\d*$", name):
        stride = 2  # TE marks stride 1 but stores [gate_r; up_r] like the local layers
    return param.partition_dim, stride, rank, size


def full_shape(local_shape: torch.Size, partition_dim: int | None, world_size: int) -> list[int]:
    """Shape of the full tensor a local shard was cut from."""
    shape = list(local_shape)
    if partition_dim is not None:
        shape[partition_dim] *= world_size
    return shape


def canonical_shards(
    model: torch.nn.Module,
    params,
    pg_collection: ProcessGroupCollection,
    num_moe_experts: int | None,
    gated_linear_unit: bool,
):
    """This rank's tensors of ``model`` with their canonical names and shard layouts.

    Args:
        model: the (unwrapped) model the tensors belong to.
        params: ``(local name, tensor)`` pairs of this rank's model.
        pg_collection: the model's process groups.
        num_moe_experts: total experts, or None for a dense model.
        gated_linear_unit: whether fc1 holds gate and up projections.

    Yields:
        ``(local name, tensor, canonical name, (partition dim, stride, rank, size))``
        (see :func:`canonical_name`, :func:`shard_layout`).
    """
    ep = pg_collection.ep
    ep_size, ep_rank = (1, 0) if ep is None else (ep.size(), ep.rank())
    num_local = (num_moe_experts or 0) // ep_size
    offset = decoder_layer_offset(model)
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    for name, param in params:
        canon = canonical_name(
            name,
            ep_rank=ep_rank,
            num_local_experts=num_local,
            layer_offset=offset,
            tied_output=tied,
        )
        yield name, param, canon, shard_layout(name, param, pg_collection, gated_linear_unit)


def shard_full_tensor(
    full: torch.Tensor, partition_dim: int | None, stride: int, rank: int, world_size: int
) -> torch.Tensor:
    """This rank's shard of a full tensor (Megatron's ``_initialize_affine_weight_cpu`` split).

    Args:
        full: the unsharded tensor.
        partition_dim: dimension split across the TP group, or None (replicated).
        stride: number of interleaved blocks per rank along ``partition_dim``.
        rank: this rank in the TP group.
        world_size: TP group size.

    Returns:
        The local shard (a new contiguous tensor).
    """
    if partition_dim is None or world_size == 1:
        return full.clone()
    per_rank = full.shape[partition_dim] // world_size
    pieces = torch.split(full, per_rank // stride, dim=partition_dim)
    return torch.cat(pieces[rank::world_size], dim=partition_dim).contiguous()


def _init_full(canon: str, shape: list[int], seed: int, std: float, out_std: float) -> torch.Tensor:
    """Draws the full fp32 tensor of one parameter from its own generator."""
    leaf = canon.rsplit(".", 1)[-1]
    if len(shape) == 1 or leaf.startswith("bias"):
        if "norm" in canon and not leaf.startswith("bias"):
            return torch.ones(shape)
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(canon.encode())) % 2**63)
    scaled = re.search(r"(linear_proj|linear_fc2)\.weight\d*$", canon) is not None
    return torch.empty(shape).normal_(0.0, out_std if scaled else std, generator=gen)


@torch.no_grad()
def initialize_weights(
    model: torch.nn.Module,
    *,
    seed: int,
    init_method_std: float,
    num_layers: int,
    num_moe_experts: int | None,
    gated_linear_unit: bool,
    pg_collection: ProcessGroupCollection,
) -> None:
    """Fills every parameter from the seed, independently of the parallel layout.

    Weights ~ N(0, std); output projections (``linear_proj``, ``linear_fc2``) use
    Megatron's scaled std ``std / sqrt(2 * num_layers)``; norm weights 1; biases 0.

    Args:
        model: the freshly built model (parameters on their final device).
        seed: weight seed.
        init_method_std: std of the normal init.
        num_layers: decoder layers (for the scaled output init).
        num_moe_experts: total experts, or None for a dense model.
        gated_linear_unit: whether fc1 holds gate and up projections.
        pg_collection: the model's process groups.
    """
    out_std = init_method_std / math.sqrt(2.0 * num_layers)
    params = canonical_shards(
        model, model.named_parameters(), pg_collection, num_moe_experts, gated_linear_unit
    )
    for _, param, canon, (dim, stride, rank, size) in params:
        full = _init_full(canon, full_shape(param.shape, dim, size), seed, init_method_std, out_std)
        param.copy_(shard_full_tensor(full, dim, stride, rank, size).to(param.dtype))
    logger.info("initialised %d parameters from seed %d", len(list(model.parameters())), seed)

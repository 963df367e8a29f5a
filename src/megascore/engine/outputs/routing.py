"""MoE routing out and in: Megatron's ``RouterReplay`` on the packed THD layout.

A *routing* is, for every token of a batch (request layout, the flat ``[T]`` token
axis), the top-k expert ids the router of every MoE layer of the decoder chose:
an int array ``[T, num_moe_layers, topk]``. MoE layers are counted in decoder order
(the MTP block's layers are not part of it: they never change a logprob); expert
ids are global (``0 <= id < num_moe_experts``), whatever the EP split.

Megatron-Core 0.19 ships the mechanism (``megatron.core.transformer.moe.
router_replay``): with ``TransformerConfig.moe_enable_routing_replay`` every
``TopKRouter`` owns a ``RouterReplay`` whose action decides what its top-k does:

* ``RECORD``: route as usual and keep the chosen ids (``[n, topk]``, n = the
  tokens this router sees on this rank);
* ``REPLAY_FORWARD``: skip the top-k, take the given ids and gather the router's
  own scores at them (probabilities are therefore the model's, only the choice is
  replayed).

This module maps both onto the packed layout of :mod:`megascore.engine.layout.packing`:

* a step runs in microbatches (:mod:`megascore.engine.schedule.pipeline`); a router sees,
  per microbatch, this rank's CP shard (:func:`megascore.engine.layout.packing.cp_shard_indices`)
  and, with sequence parallelism, only the TP rank's contiguous ``1 / tp`` slice of
  it; with EP the routing is computed before the token dispatch, on the rank's own
  tokens (its data-parallel part of the step, :mod:`megascore.engine.schedule.data_parallel`;
  each DP rank records / replays its part's routes); with PP a
  stage holds the routers of its own layers (:func:`stage_moe_layers`, from
  Megatron's layer offsets and MoE layer pattern);
* the schedule's forward step replays (:func:`set_replay_targets`) or reads
  (:func:`recorded_routes`) each microbatch's ids around the model call;
* recorded routes are all-gathered over TP (the SP slices) and CP (the shards, into
  natural packed order), the stages' layers are brought to the output rank over its
  pipeline group (:func:`gather_routes`), and the step keeps the real tokens only
  (``PackedSequences.token_positions``): pad positions never leave the engine;
* replay scatters the request's routing onto the microbatch's packed axis, gives
  every pad position the valid route ``0 .. k-1`` (pads come after the real tokens
  of their segment, so causal attention never lets them reach a real token), then
  takes this rank's CP shard, SP slice and stage layers
  (:func:`local_replay_targets`).

The ids of a token are in the router's top-k order. Record -> replay of the same
array reproduces the forward bit for bit: the replayed order is the recorded one
(the top-k normalisation sums in that order). Routers are driven per model, never
through ``RouterReplay``'s process-wide static list (which holds every model ever
built in the process); actions and ids are cleared after every forward.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_moe_layer_pattern,
)
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megascore.api.limits import RoutingShape
from megascore.engine.layout.packing import PackedSequences
from megascore.engine.ranks.distributed import collective_device, gather_cp_shards

logger = logging.getLogger(__name__)


def decoder_routers(model) -> list[TopKRouter]:
    """The routers of this stage's decoder MoE layers, in layer order (MTP excluded)."""
    return [layer.mlp.router for layer in model.decoder.layers if isinstance(layer.mlp, MoELayer)]


def stage_moe_layers(config, pp_rank: int) -> list[int]:
    """Indices among the model's MoE layers (``0 .. L-1``) of pipeline stage ``pp_rank``'s.

    Args:
        config: the model's ``TransformerConfig``.
        pp_rank: the stage.

    Returns:
        Consecutive indices, in layer order (empty for a stage without MoE layers).
    """
    pattern = get_moe_layer_pattern(config)
    first = get_transformer_layer_offset(config, vp_stage=None, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=None, pp_rank=pp_rank)
    before = sum(pattern[:first])
    return list(range(before, before + sum(pattern[first : first + count])))


def routing_shape(model) -> RoutingShape | None:
    """The :class:`~megascore.api.limits.RoutingShape` of a built model (all stages' layers).

    Returns:
        None for a model without MoE layers, or one whose routing bypasses
        ``RouterReplay`` (Megatron's fused top-k, sinkhorn or quantile routing; logged).
    """
    cfg = model.config
    if not cfg.num_moe_experts:
        return None
    routers = decoder_routers(model)
    bypassed = ("sinkhorn", "quantile_balancing")  # routings that never call RouterReplay
    if (
        not cfg.moe_enable_routing_replay
        or cfg.moe_router_fusion
        or any(r.routing_type in bypassed for r in routers)
    ):
        logger.warning(
            "MoE routing cannot be recorded or replayed (moe_enable_routing_replay %s, "
            "moe_router_fusion %s, load balancing %r)",
            cfg.moe_enable_routing_replay,
            cfg.moe_router_fusion,
            cfg.moe_router_load_balancing_type,
        )
        return None
    return RoutingShape(sum(get_moe_layer_pattern(cfg)), cfg.moe_router_topk, cfg.num_moe_experts)


def _sp_slice(tp_group: dist.ProcessGroup, sequence_parallel: bool) -> tuple[int, int]:
    """``(rank, size)`` of the sequence-parallel split of a CP shard (``(0, 1)`` without SP)."""
    if not sequence_parallel or dist.get_world_size(tp_group) == 1:
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def local_replay_targets(
    routing: np.ndarray,
    packed: PackedSequences,
    layers: list[int],
    *,
    tp_group: dist.ProcessGroup,
    sequence_parallel: bool,
    device: torch.device,
) -> torch.Tensor:
    """The ids this rank's routers replay for one microbatch.

    Args:
        routing: integer ``[T_mb, L, k]``: the microbatch's tokens' routes (checked).
        packed: the microbatch packed for this rank's CP rank.
        layers: this stage's MoE layers (:func:`stage_moe_layers`).
        tp_group: the tensor-parallel group.
        sequence_parallel: whether the routers see the SP slice of the CP shard.
        device: the model's device.

    Returns:
        int64 ``[n, len(layers), k]``: row ``i`` is the route of the i-th token this
        rank's routers see (pad positions route to experts ``0 .. k-1``).
    """
    topk = routing.shape[2]
    total = int(packed.cu_seqlens_padded[-1])
    full = torch.arange(topk, dtype=torch.long).expand(total, len(layers), topk).clone()
    stage = np.asarray(routing, dtype=np.int64)[:, layers]
    full[packed.token_positions] = torch.from_numpy(stage)
    local = full[packed.shard_indices]
    sp_rank, sp_size = _sp_slice(tp_group, sequence_parallel)
    n = local.shape[0] // sp_size
    return local[sp_rank * n : (sp_rank + 1) * n].to(device)


@contextlib.contextmanager
def routing_replay(model, *, record: bool, replay: bool):
    """Puts this stage's routers in ``RECORD`` or ``REPLAY_FORWARD`` for the block.

    Inside, the forward step of each microbatch calls :func:`set_replay_targets`
    before the model (replay) or :func:`recorded_routes` after it (record). Actions
    and ids are cleared on exit.
    """
    replays = [r.router_replay for r in decoder_routers(model)] if record or replay else []
    action = RouterReplayAction.REPLAY_FORWARD if replay else RouterReplayAction.RECORD
    for rr in replays:
        rr.set_router_replay_action(action)
    try:
        yield
    finally:
        for rr in replays:
            rr.clear_indices()
            rr.clear_router_replay_action()


def set_replay_targets(model, targets: torch.Tensor) -> None:
    """Gives this stage's routers the ids to replay in the next forward.

    Args:
        model: this rank's model, inside :func:`routing_replay` with ``replay``.
        targets: int64 ``[n, L_stage, k]`` (:func:`local_replay_targets`).
    """
    for i, router in enumerate(decoder_routers(model)):
        router.router_replay.set_target_indices(targets[:, i, :].contiguous())


def recorded_routes(model) -> torch.Tensor | None:
    """The ids this stage's routers chose in the last forward.

    Args:
        model: this rank's model, inside :func:`routing_replay` with ``record``.

    Returns:
        int64 ``[n, L_stage, k]``, or None on a stage without MoE layers.
    """
    chosen = [r.router_replay.get_recorded_indices() for r in decoder_routers(model)]
    missing = [i for i, ids in enumerate(chosen) if ids is None]
    if missing:
        raise RuntimeError(f"MoE layers {missing} of this stage recorded no routing")
    if not chosen:
        return None
    return torch.stack([ids.long() for ids in chosen], dim=1)  # L x [n, k] -> [n, L, k]


def gather_routes(
    local: list[torch.Tensor | None],
    packed: list[PackedSequences],
    topk: int,
    *,
    tp_group: dist.ProcessGroup,
    cp_group: dist.ProcessGroup,
    pp_group: dist.ProcessGroup,
    sequence_parallel: bool,
    config,
    output_rank: int,
) -> torch.Tensor | None:
    """Every stage's recorded routes of a step, on the output rank.

    Collective: every rank takes part in the TP and CP all-gathers (ints, small); the
    output rank's pipeline group then broadcasts each stage's layers from that stage.

    Args:
        local: per microbatch, int64 ``[n, L_stage, k]`` recorded on this rank (None
            on a stage without MoE layers).
        packed: per microbatch, its packing on this rank (common padded length).
        topk: experts per token.
        tp_group: the tensor-parallel group.
        cp_group: the context-parallel group.
        pp_group: the pipeline group.
        sequence_parallel: whether the routers saw SP slices.
        config: the model's ``TransformerConfig`` (stage layers).
        output_rank: the global rank that builds the output (first stage).

    Returns:
        int64 ``[M * T_mb, L, k]`` on the CPU on the output rank (microbatch ``i`` in
        rows ``[i * T_mb, (i + 1) * T_mb)``), None elsewhere.
    """
    _, sp_size = _sp_slice(tp_group, sequence_parallel)
    rows = []
    for routes, mb in zip(local, packed, strict=True):
        if routes is None:  # same on every rank of this stage: no collective
            rows.append(torch.empty(int(mb.cu_seqlens_padded[-1]), 0, topk, dtype=torch.long))
            continue
        if sp_size > 1:
            slices = [torch.empty_like(routes) for _ in range(sp_size)]
            dist.all_gather(slices, routes.contiguous(), group=tp_group)
            routes = torch.cat(slices)
        if dist.get_world_size(cp_group) > 1:
            cu = mb.cu_seqlens_padded.to(routes.device, torch.long)
            routes = gather_cp_shards(routes.unsqueeze(0), cu, cp_group)[0]
        rows.append(routes.cpu())
    stage = torch.cat(rows).cpu()  # [M * T_mb, L_stage, k]
    pp_ranks = dist.get_process_group_ranks(pp_group)
    if output_rank not in pp_ranks:
        return None
    if len(pp_ranks) > 1:
        device = collective_device(pp_group)
        parts = []
        for pp_rank, src in enumerate(pp_ranks):
            shape = (stage.shape[0], len(stage_moe_layers(config, pp_rank)), stage.shape[2])
            if shape[1] == 0:
                continue
            buffer = stage.to(device) if src == dist.get_rank() else None
            if buffer is None:
                buffer = torch.empty(shape, dtype=torch.long, device=device)
            dist.broadcast(buffer, src=src, group=pp_group)
            parts.append(buffer.cpu())
        stage = torch.cat(parts, dim=1)
    return stage if dist.get_rank() == output_rank else None

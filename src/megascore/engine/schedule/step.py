"""One engine step on one rank: pack, forward, score, gather, agree, unpack.

Every rank of a TP x CP x PP group runs :func:`run_step` with the same
:class:`~megascore.api.types.ScoreBatch` (broadcast by rank 0; with data-parallel ranks, the
DP rank's part of it and its microbatch plan, :mod:`megascore.engine.schedule.data_parallel`):

1. split the batch into microbatches
   (:func:`megascore.engine.layout.microbatch_plan.split_microbatches`)
   and pack each from the flat ids for this rank's CP rank (NeMo-RL layout), with
   next-token targets rolled inside each padded segment on the *full* packed axis
   and then CP-sharded like the inputs;
2. run them through Megatron's forward-only schedule
   (:func:`megascore.engine.schedule.pipeline.run_schedule`), the MoE routers recording or
   replaying routes when the batch asks (:mod:`megascore.engine.outputs.routing`; recorded
   routes are gathered to the output rank after the schedule): on the last pipeline stage
   each microbatch's output head (final hidden states + output layer) gives the
   logprobs / top-k over the TP group (:func:`megascore.engine.outputs.logprobs.score_tokens`),
   chunk by chunk: the head computes the vocab-parallel logits of ``chunk_tokens``
   rows at a time, so ``[T_local, V/tp]`` never exists;
3. on the last stage, the CP group that holds the *result rank* (the output rank's
   peer there) gathers the per-token results (each in its own dtype: top-k ids stay
   int64); with PP > 1 the result rank broadcasts them, typed, with shapes every
   receiver derives from the batch (no pickling), over the output rank's pipeline
   group;
4. every rank all-reduces a per-rank failure flag over the status group, so a
   rank that raised anywhere in 1-3 is known to all (the others reach the flag
   after their own collectives time out) and :class:`StepFailedError` is raised
   on every rank.

The output rank then turns the gathered packed results into a
:class:`~megascore.api.types.ScoreOutput` with
:func:`~megascore.engine.schedule.step_output.finish_step` (local work only),
through the packed <-> flat index that packing built (``token_positions``).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch
import torch.distributed as dist

from megascore.api import layout, schema
from megascore.api.errors import WorkerLostError
from megascore.api.metric_sums import MetricSums
from megascore.api.types import ScoreBatch
from megascore.engine.cache.store import PrefixStore, microbatch_cache, sequence_slots
from megascore.engine.layout.microbatch import Microbatch, build_microbatch
from megascore.engine.layout.microbatch_plan import (
    MicrobatchPlan,
    MicrobatchSegments,
    plan_microbatches,
)
from megascore.engine.outputs.routing import (
    gather_routes,
    local_replay_targets,
    routing_replay,
    stage_moe_layers,
)
from megascore.engine.ranks.distributed import collective_device
from megascore.engine.schedule.adapter_rows import adapter_keys, set_adapter_rows
from megascore.engine.schedule.forward import mtp_metric_names, scoring_forward
from megascore.engine.schedule.pipeline import ScoreSpec, run_schedule

logger = logging.getLogger(__name__)


class StepFailedError(WorkerLostError):
    """A rank failed during a step; the collectives of the replica may be out of step."""


@dataclasses.dataclass(frozen=True)
class StepGroups:
    """The process groups a step uses (all required).

    Attributes:
        tp: tensor-parallel group (vocabulary split of the logits).
        cp: context-parallel group (token split of the packed sequence).
        pp: pipeline group (this rank's peers on the other stages).
        status: every rank of the replica; carries the per-step failure flags.
            A gloo group whose timeout is the collective timeout.
    """

    tp: dist.ProcessGroup
    cp: dist.ProcessGroup
    pp: dist.ProcessGroup
    status: dist.ProcessGroup


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Per-replica constants of a step.

    Attributes:
        pad_multiple: per-sequence pad multiple
            (:meth:`megascore.config.EngineConfig.pad_multiple`).
        chunk_tokens: tokens per chunk of the vocab-parallel log-softmax.
        vocab_size: true vocabulary size (padded logit columns never enter the top-k).
        device: device of the model inputs.
        microbatches: microbatches per step (fewer when a step is small).
        output_rank: global rank that builds the :class:`ScoreOutput` (first stage, TP 0,
            CP 0 of this rank's DP rank; global rank 0 for DP rank 0).
        result_rank: its peer on the last pipeline stage, where the results are
            computed (the output rank itself at PP = 1).
        lm_head_dtype: "model" (logits in the model dtype, as Megatron) or "float32".
        metrics_reduction: "step" or "microbatch"
            (:func:`megascore.engine.schedule.forward.scoring_forward`).
        data_parallel_split: the DP ranks score different sequences of the step (their
            step-level metric statistics are summed); False: copies of one batch.
        min_shared_prefix: shortest prefix the step's sequences share that is computed
            once (:mod:`megascore.engine.layout.prefix_tree`); None: every sequence computed whole.
        prefix_store: this rank's shard of the prefix cache (:mod:`megascore.engine.cache`),
            which a batch with a cache plan reads and writes; None: no cache.
    """

    pad_multiple: int
    chunk_tokens: int
    vocab_size: int
    device: torch.device
    microbatches: int = 1
    output_rank: int = 0
    result_rank: int = 0
    lm_head_dtype: str = "model"
    metrics_reduction: str = "step"
    data_parallel_split: bool = False
    min_shared_prefix: int | None = None
    prefix_store: PrefixStore | None = None


@dataclasses.dataclass
class StepResult:
    """What :func:`run_step` returns on a rank.

    The per-token head outputs (:func:`megascore.api.schema.head_outputs`) are in packed
    order (position ``p`` predicts the token at ``p + 1`` of its segment), gathered
    over CP, on the CPU, on the ranks of the output rank's CP group; absent elsewhere.

    Attributes:
        values: head output name -> ``[T_padded, *dims]`` tensor (an output at each
            sequence's last row, :func:`megascore.api.schema.at_last_row`: ``[B, *dims]``
            in the batch's order).
        token_positions: int64 ``[T]`` packed position of every token of the batch
            on the step's packed axis (microbatch ``i`` occupies rows
            ``[i * L, (i + 1) * L)``, ``L`` the common microbatch length).
        loss: token-mean NLL of the step's scored tokens (the sum of the microbatch
            losses; a shared prefix's rows count once; set where the results are, else
            None).
        moe_metrics: MoE metric name -> value of this forward (every rank).
        mtp_metrics: MTP metric name -> value of this forward (where the results are).
        metric_sums: what the metrics were formed from (``metrics_reduction`` "step"),
            None otherwise.
        routing: int64 ``[T_padded, L, k]`` MoE routes recorded at each position (not
            shifted: position ``p`` holds its own token's route), on the output rank
            when the batch asks to record them; None elsewhere.
    """

    values: dict[str, torch.Tensor]
    token_positions: torch.Tensor
    loss: float | None
    moe_metrics: dict[str, float]
    mtp_metrics: dict[str, float]
    metric_sums: MetricSums | None = None
    routing: torch.Tensor | None = None


@dataclasses.dataclass
class _Plan:
    """Stage 1 of a step on this rank: the microbatches and what to compute."""

    microbatches: list[Microbatch]
    layouts: list[MicrobatchSegments]
    tokens: list[np.ndarray | slice]
    pad_to: int
    spec: ScoreSpec
    record: bool
    want_moe: bool
    want_mtp: bool


def shared_prefix(model, batch: ScoreBatch, cfg: StepConfig) -> int | None:
    """The step's shortest shared prefix, or None for a dense step: sharing off, or MoE /
    MTP metrics read from Megatron's per-microbatch trackers (``metrics_reduction``
    "microbatch": they see the packed rows). Step metrics weigh each shared row by the
    sequences it stands for (:mod:`megascore.engine.outputs.step_metrics`)."""
    per_microbatch = any(_metrics_forward(model, batch)) and cfg.metrics_reduction != "step"
    return None if per_microbatch else cfg.min_shared_prefix


def lead_rows(model, batch: ScoreBatch) -> int:
    """Rows a continuation computes again of its prefix: 1, or :func:`metrics_lead_rows`
    in a step that records MoE / MTP metrics (:mod:`megascore.engine.layout.prefix_tree`)."""
    return metrics_lead_rows(model.config) if any(_metrics_forward(model, batch)) else 1


def metrics_lead_rows(config) -> int:
    """Rows a continuation computes again of its prefix in a metrics step: 1 + the MTP
    layers (a metrics forward runs them)."""
    return 1 + (config.mtp_num_layers or 0)


def _metrics_forward(model, batch: ScoreBatch) -> tuple[bool, bool]:
    """Whether the step records MoE and MTP metrics (a model without such layers has
    empty metrics, not an error)."""
    return (
        batch.return_moe_metrics and bool(model.config.num_moe_experts),
        batch.return_mtp_metrics and bool(model.config.mtp_num_layers),
    )


def token_keys(batch: ScoreBatch) -> np.ndarray | None:
    """What must match for two tokens to be shared: the id, the routes it replays, the
    head inputs read at it (:func:`megascore.api.schema.head_inputs`: the target ids) and
    its sequence's LoRA adapter."""
    extra = [  # [T, -1] (an empty data-parallel share has T = 0 and no columns to infer)
        np.asarray(values, dtype=np.int64).reshape(batch.num_tokens, -1)
        if batch.num_tokens
        else np.zeros((0, 0), dtype=np.int64)
        for values in (batch.routing, *schema.head_inputs(batch).values(), adapter_keys(batch))
        if values is not None
    ]
    if not extra:
        return None
    return np.concatenate([np.asarray(batch.token_ids, dtype=np.int64)[:, None], *extra], 1)


def _plan(
    model, batch: ScoreBatch, groups: StepGroups, cfg: StepConfig, cuts: MicrobatchPlan | None
) -> _Plan:
    """Stage 1: split into microbatches (:func:`plan_microbatches`, sharing prefixes when
    on; ``cuts``: a data-parallel rank's share, shared or dense as its plan says) and pack
    each for this rank's CP rank; what the last stage computes (:class:`ScoreSpec`)."""
    lengths = np.asarray(batch.lengths, dtype=np.int64)
    cp_size = dist.get_world_size(groups.cp)
    want_moe, want_mtp = _metrics_forward(model, batch)
    cached = batch.cache_hits is not None
    layouts, pad_to = plan_microbatches(
        batch.token_ids,
        lengths,
        pad_multiple=cfg.pad_multiple,
        count=cfg.microbatches,
        min_shared=None if cached else shared_prefix(model, batch, cfg),
        token_keys=token_keys(batch),
        labels=batch.temperatures(),
        lead_rows=lead_rows(model, batch),
        cuts=cuts,
        offsets=batch.cache_hits,
    )
    slots = sequence_slots(batch, cfg.prefix_store) if cached else None
    target_mask = layout.effective_loss_mask(lengths, batch.scored_mask()).astype(np.float32)
    temps = None if batch.temperature is None else np.asarray(batch.temperature)
    tokens = [layout.token_index(lengths, mb.sequences) for mb in layouts]
    head_inputs = {name: np.asarray(v) for name, v in schema.head_inputs(batch).items()}
    microbatches = [
        build_microbatch(
            mb.segments,
            None if temps is None else temps[mb.sequences],
            target_mask[tok],
            device=cfg.device,
            pad_multiple=cfg.pad_multiple,
            pad_to=pad_to,
            cp_rank=dist.get_rank(groups.cp),
            cp_size=cp_size,
            has_request_mask=batch.loss_mask is not None,
            lengths=lengths[mb.sequences],
            head_inputs={name: values[tok] for name, values in head_inputs.items()},
            cache=None if slots is None else _microbatch_cache(mb, slots, pad_to, cfg),
        )
        for mb, tok in zip(layouts, tokens, strict=True)
    ]
    last_stage = groups.pp.rank() == groups.pp.size() - 1
    record = batch.return_routing and batch.routing is None  # a replayed routing is known
    outputs = schema.head_outputs(batch)
    spec = ScoreSpec(
        outputs=tuple(outputs),
        top_k=batch.top_k,
        chunk_tokens=cfg.chunk_tokens,
        vocab_size=cfg.vocab_size,
        global_valid_tokens=max(1, int(target_mask.sum())),
        num_microbatches=len(microbatches),
        gather=last_stage and cfg.result_rank in dist.get_process_group_ranks(groups.cp),
        metrics_forward=want_moe or want_mtp,
        lm_head_dtype=cfg.lm_head_dtype,
        record_routes=record,
        # only the losses leave the step, or the outputs are asked for at the masked
        # positions only: the head runs where the loss mask scores a token (the last
        # rows of the sequences are computed apart, schema.at_last_row)
        scored_rows_only=batch.logprob_positions == schema.MASKED
        or not any(out.wanted(batch) for out in outputs if not schema.at_last_row(out)),
    )
    return _Plan(microbatches, layouts, tokens, pad_to, spec, record, want_moe, want_mtp)


def _microbatch_cache(mb: MicrobatchSegments, slots: list[np.ndarray], pad_to: int, cfg):
    """A microbatch's cached rows and cache view (its segments: one per sequence)."""
    return microbatch_cache(
        mb.segments.offsets,
        mb.segments.lengths,
        [slots[b] for b in mb.sequences[mb.segments.sequences]],
        pad_to,
        layout.offsets(layout.padded_lengths(mb.segments.lengths, cfg.pad_multiple))[:-1],
        cfg.prefix_store,
        cfg.device,
    )


def _set_replay(model, batch: ScoreBatch, plan: _Plan, groups: StepGroups, cfg: StepConfig):
    """Stage 1b: each microbatch's routes to replay on this stage's routers (a row of a
    shared segment replays the routes of the token it computes)."""
    layers = stage_moe_layers(model.config, groups.pp.rank())
    routing = np.asarray(batch.routing)
    for mb, layout_, tok in zip(plan.microbatches, plan.layouts, plan.tokens, strict=True):
        mb.replay_routes = local_replay_targets(
            routing[tok][layout_.segments.row_source],
            mb.packed,
            layers,
            tp_group=groups.tp,
            sequence_parallel=bool(model.config.sequence_parallel),
            device=cfg.device,
        )


def _local_results(
    model, batch: ScoreBatch, groups: StepGroups, cfg: StepConfig, cuts: MicrobatchPlan | None
) -> StepResult:
    """Steps 1-3 of the module docstring on this rank (issues the step's collectives)."""
    plan = _plan(model, batch, groups, cfg, cuts)
    if batch.routing is not None:
        _set_replay(model, batch, plan, groups, cfg)
    if batch.adapter is not None:
        set_adapter_rows(batch, plan.microbatches, plan.layouts)
    microbatches = plan.microbatches
    with (  # stage 2: the forward, the last stage scoring each microbatch
        routing_replay(model, record=plan.record, replay=batch.routing is not None),
        scoring_forward(
            model,
            return_moe_metrics=plan.want_moe,
            return_mtp_metrics=plan.want_mtp,
            num_microbatches=len(microbatches),
            metrics_reduction=cfg.metrics_reduction,
            data_parallel_split=cfg.data_parallel_split,
        ) as metrics,
    ):
        store = run_schedule(model, microbatches, plan.spec)
    positions = torch.empty(batch.num_tokens, dtype=torch.long)
    for i, (mb, tok) in enumerate(zip(microbatches, plan.tokens, strict=True)):
        positions[tok] = mb.token_positions + i * plan.pad_to
    result = StepResult(
        values={},
        token_positions=positions,
        loss=None,
        moe_metrics=dict(metrics.moe),
        mtp_metrics=dict(metrics.mtp),
        metric_sums=metrics.sums,
    )
    if plan.record:  # stage 3: recorded routes to the output rank, [M * pad_to, L, k]
        result.routing = gather_routes(
            [mb.recorded_routes for mb in microbatches],
            [mb.packed for mb in microbatches],
            model.config.moe_router_topk,
            tp_group=groups.tp,
            cp_group=groups.cp,
            pp_group=groups.pp,
            sequence_parallel=bool(model.config.sequence_parallel),
            config=model.config,
            output_rank=cfg.output_rank,
        )
    # stage 3: the microbatches' results, joined: per token in packed order, per sequence
    # (schema.at_last_row) in the batch's
    order = np.concatenate([mb.sequences for mb in plan.layouts]).astype(np.int64)
    order = torch.from_numpy(order)
    if plan.spec.gather:
        for out in plan.spec.outputs:
            joined = torch.cat([results[out.name] for results in store])
            if schema.at_last_row(out):
                joined = torch.empty_like(joined).index_copy_(0, order, joined)
            result.values[out.name] = joined
        result.loss = float(sum(results["loss"] for results in store))
    if groups.pp.size() > 1 and cfg.output_rank in dist.get_process_group_ranks(groups.pp):
        mtp_names = mtp_metric_names(model.config) if plan.want_mtp else []
        rows = {schema.TOKEN: len(microbatches) * plan.pad_to, schema.SEQUENCE: len(order)}
        _send_results_to_output_rank(result, batch, plan.spec, rows, mtp_names, groups.pp, cfg)
    return result


def _send_results_to_output_rank(
    result: StepResult,
    batch: ScoreBatch,
    spec: ScoreSpec,
    rows: dict[str, int],
    mtp_names: list[str],
    pp_group: dist.ProcessGroup,
    cfg: StepConfig,
) -> None:
    """Broadcasts the results from the result rank over the output rank's pipeline group.

    Typed: every receiver allocates the buffers from the step's head outputs (``rows``
    by ``per``: packed positions, or sequences; each output's dtype and trailing shape,
    the MTP metric names), so only tensors travel. Fills ``result`` in place on the
    receivers.
    """
    device = collective_device(pp_group)
    is_src = dist.get_rank() == cfg.result_rank
    for out in spec.outputs:
        if is_src:
            tensor = result.values[out.name].to(device).contiguous()
        else:
            shape = (rows[out.per], *schema.flat_dims(out, batch))  # the batch's options
            tensor = torch.empty(shape, dtype=getattr(torch, out.dtype), device=device)
        dist.broadcast(tensor, src=cfg.result_rank, group=pp_group)
        result.values[out.name] = tensor.cpu()
    scalars = torch.zeros(1 + len(mtp_names), dtype=torch.float64, device=device)
    if is_src:
        scalars[0] = result.loss
        scalars[1:] = torch.tensor([result.mtp_metrics[n] for n in mtp_names], dtype=torch.float64)
    dist.broadcast(scalars, src=cfg.result_rank, group=pp_group)
    values = scalars.cpu().tolist()
    result.loss = values[0]
    result.mtp_metrics = dict(zip(mtp_names, values[1:], strict=True))


def agree_on_status(failed: bool, status_group: dist.ProcessGroup) -> list[int]:
    """All-reduces one failure flag per rank.

    Args:
        failed: whether this rank failed the step.
        status_group: every rank of the replica (gloo, collective timeout).

    Returns:
        Global ranks that reported a failure (same list on every rank).

    Raises:
        RuntimeError: the all-reduce itself failed or timed out (a rank is gone).
    """
    ranks = dist.get_process_group_ranks(status_group)
    if len(ranks) == 1:  # a one-rank replica: nothing to agree on (no collective)
        return ranks if failed else []
    flags = torch.zeros(len(ranks), dtype=torch.int32)
    flags[dist.get_rank(status_group)] = int(failed)
    dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=status_group)
    return [ranks[i] for i in torch.nonzero(flags).flatten().tolist()]


def wait_for_device(device: torch.device) -> None:
    """Waits for the step's queued CUDA work, so that an asynchronous CUDA error (a
    faulting kernel, a failed NCCL collective) raises on this rank before it reports
    success to the status all-reduce. A no-op on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run_step(
    model,
    batch: ScoreBatch,
    groups: StepGroups,
    cfg: StepConfig,
    cuts: MicrobatchPlan | None = None,
) -> StepResult:
    """Runs one forward step on this rank and agrees on its outcome with every rank.

    Args:
        model: the (eval-mode) Megatron model of this rank.
        batch: the batch of this rank's TP x CP x PP group (with data-parallel ranks,
            this rank's part of the step: :mod:`megascore.engine.schedule.data_parallel`).
        groups: process groups of the step.
        cfg: per-replica step constants.
        cuts: the microbatches to run (None: :meth:`MicrobatchPlan.split` of the batch).

    Returns:
        This rank's :class:`StepResult`.

    Raises:
        StepFailedError: on every rank when any rank failed the step (the message
            names the failed ranks and this rank's own error, if any).
    """
    error: BaseException | None = None
    result = None
    try:
        result = _local_results(model, batch, groups, cfg, cuts)
        wait_for_device(cfg.device)
    except Exception as e:  # reported to every rank through the status all-reduce
        logger.exception("rank %d: step failed", dist.get_rank())
        error = e
    try:
        failed = agree_on_status(error is not None, groups.status)
    except Exception as e:
        raise StepFailedError(f"step status all-reduce failed (a rank is lost): {e}") from e
    if failed:
        own = f"; this rank: {type(error).__name__}: {error}" if error is not None else ""
        raise StepFailedError(f"step failed on ranks {failed}{own}") from error
    assert result is not None
    return result

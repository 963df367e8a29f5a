"""One packed GPTModel forward: the LM head's input plus the MoE / MTP metrics.

The pieces are what Megatron's schedule calls per microbatch
(:mod:`megascore.engine.schedule.pipeline`):
:func:`~megascore.engine.schedule.packed_inputs.model_inputs`
builds the model's arguments, :func:`scoring_forward` is the mode a whole step runs in
(and reads the metrics after it).

:func:`forward_microbatch` feeds a :class:`~megascore.engine.layout.packing.PackedSequences` (THD,
this rank's CP shard) through the model and returns an
:class:`~megascore.engine.outputs.output_head.OutputHead`: the final hidden states (after the
final layernorm) and the model's output layer, which computes the vocab-parallel logits
``[C, V / tp]`` of any chunk of rows on demand. The full ``[T_local, V / tp]`` logits
are never materialised (they are the classic OOM of prompt-logprob servers: 64k tokens x
128k vocabulary in fp32 is 32 GB); :func:`megascore.engine.outputs.logprobs.score_tokens` asks
for one chunk of ``chunk_tokens`` rows at a time. The head comes from an ``output_processor`` hook
of ``GPTModel.forward``: Megatron calls it with the final hidden states after
the MTP block, in place of its own output-layer / loss step, so GPTModel never
computes the main logits itself (MTP needs labels; with labels GPTModel would
otherwise return the per-token loss).

Metrics. Megatron records MoE aux losses and MTP losses only in training mode
(aux losses also need grad enabled). When metrics are requested the model runs
one training-mode forward with dropout off and grad enabled (parameters do not
require grad, nothing is back-propagated), then restores the routers' running
buffers and returns the model to eval mode. The hidden states are identical in both
modes (dropout is off, MoE is dropless). Two definitions (``metrics_reduction``,
docs/engine.md):

* ``"step"`` (default): the statistics the routers and MTP layers see over the whole
  step, reduced once (:mod:`megascore.engine.outputs.step_metrics`): the same for any layout
  and microbatch count; with DP > 1 each DP rank scores its own part of the step
  (:mod:`megascore.engine.schedule.data_parallel`) and the statistics are summed over them;
* ``"microbatch"``: Megatron's trackers, read exactly as Megatron's ``training.py``
  reads them (``MoEMetricsTracker.report`` with ``force_initialize``;
  ``MTPLossLoggingHelper.track_mtp_metrics``): the mean over the step's microbatches.
  Where Megatron's value depends on the layout beyond that, megascore corrects it:

  - Megatron's ``padding_mask`` marks the pad positions of the packed layout, so the
    routers leave pads out of the aux-loss and z-loss statistics (MTP layers too:
    ``megascore.model.mtp``): MoE metrics do not depend on the per-sequence pad
    multiple, hence not on the TP / CP layout either (this holds for both);
  - an MTP loss is the token-weighted mean over the DP x CP ranks (each rank's masked
    mean of a microbatch weighted by its share of the microbatch's target tokens:
    equal to CP = 1); acceptance rates sum the counts (percent, as Megatron logs them);
  - with DP > 1 z-loss and MTP losses are token-weighted over the DP ranks, the aux
    losses count the tokens of every DP rank, so the metrics are those of the step's
    microbatches over all DP ranks.

Either way Megatron's MTP loss (``process_mtp_loss``) computes each MTP layer's full
``[T_local, V / tp]`` logits: a metrics forward of an MTP model is the one place where
memory still grows with tokens x vocabulary.

An eval forward whose MTP outputs nobody reads skips the MTP block (it only
produces MTP losses): ``model.mtp_process`` and ``config.mtp_num_layers`` are
switched off for that call and restored after it (single-threaded engine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
from megatron.core.transformer.moe.moe_logging import (
    destroy_moe_metrics_tracker,
    get_moe_metrics_tracker,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from megascore.api.metric_sums import MetricSums
from megascore.config import METRICS_REDUCTIONS
from megascore.engine.layout.packing import PackedSequences
from megascore.engine.layout.segment_packing import rope_positions
from megascore.engine.outputs import step_metrics
from megascore.engine.schedule.packed_inputs import model_inputs, router_token_counts

logger = logging.getLogger(__name__)


def moe_metric_names(cfg) -> list[str]:
    """MoE metrics a model reports: the aux losses configured with a coefficient > 0, z_loss.

    Args:
        cfg: a ``ModelConfig`` or ``TransformerConfig`` (same field names).

    Returns:
        Names among ``load_balancing_loss``, ``seq_load_balancing_loss``,
        ``global_load_balancing_loss``, ``z_loss``; empty for a dense model.
    """
    if not cfg.num_moe_experts:
        return []
    types = cfg.moe_router_load_balancing_type
    coeffs = cfg.moe_aux_loss_coeff
    if isinstance(types, str):
        types, coeffs = [types], [coeffs]
    elif not isinstance(coeffs, list | tuple):
        coeffs = [coeffs] * len(types)
    names = []
    for aux_type, name in (
        ("aux_loss", "load_balancing_loss"),
        ("seq_aux_loss", "seq_load_balancing_loss"),
        ("global_aux_loss", "global_load_balancing_loss"),
    ):
        if aux_type in types and coeffs[types.index(aux_type)] > 0:
            names.append(name)
    if cfg.moe_z_loss_coeff:
        names.append("z_loss")
    return names


def mtp_metric_names(cfg) -> list[str]:
    """``mtp_{i}_loss`` and ``mtp_{i}_acceptance_rate`` for i in 1..mtp_num_layers."""
    names = []
    for i in range(1, (cfg.mtp_num_layers or 0) + 1):
        names += [f"mtp_{i}_loss", f"mtp_{i}_acceptance_rate"]
    return names


class _ScalarCollector:
    """Minimal ``SummaryWriter`` stand-in that keeps the scalars Megatron logs."""

    def __init__(self):
        self.scalars: dict[str, float] = {}

    def add_scalar(self, name: str, value, iteration: int) -> None:
        self.scalars[name] = float(value)


@contextlib.contextmanager
def _mtp_skipped(model):
    """Skips the MTP block in an eval forward whose MTP outputs nobody reads."""
    if not getattr(model, "mtp_process", False):
        yield
        return
    saved = model.config.mtp_num_layers
    model.mtp_process, model.config.mtp_num_layers = False, None
    try:
        yield
    finally:
        model.mtp_process, model.config.mtp_num_layers = True, saved


@contextlib.contextmanager
def _training_forward(model):
    """Training mode with grad enabled; restores eval mode and the routers' buffers.

    The routers' expert-bias token counts (``local_tokens_per_expert``, a training-only
    buffer restored afterwards anyway) are not accumulated: Megatron-Core 0.19 fails to
    broadcast a padding mask against the routing map there.
    """
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    saved = [{k: b.clone() for k, b in r.named_buffers(recurse=False)} for r in routers]
    bias_updates = [r.enable_expert_bias for r in routers]
    for router in routers:
        router.reset_global_aux_loss_tracker()  # this batch is one "global batch"
        router.enable_expert_bias = False  # routing still adds expert_bias (the buffer)
    was_training = model.training
    model.train()
    try:
        with torch.enable_grad():
            yield
    finally:
        model.train(was_training)
        with torch.no_grad():
            for router, enabled in zip(routers, bias_updates, strict=True):
                router.enable_expert_bias = enabled
            for router, bufs in zip(routers, saved, strict=True):
                for name, value in bufs.items():
                    getattr(router, name).copy_(value)


def _z_loss_values() -> torch.Tensor | None:
    entry = get_moe_metrics_tracker().metrics.get("z_loss")
    return None if entry is None else entry.values


def _token_weight_z_loss(model, packed: PackedSequences, before: torch.Tensor | None) -> None:
    """Megatron averages each rank's per-layer z-loss (a mean over its own real tokens) over
    the TP x DP x CP ranks; pads masked out leave the ranks different numbers of tokens, so
    weight this forward's contribution (the tracker's values minus ``before``) by the
    rank's share of them: the result is the mean over all the forward's real tokens."""
    values = _z_loss_values()
    router = next((m for m in model.modules() if isinstance(m, TopKRouter)), None)
    if values is None or router is None or router.tp_dp_cp_group.size() == 1:
        return
    group = router.tp_dp_cp_group
    counts = router_token_counts(model, packed).to(values.device)
    total = counts.clone()
    torch.distributed.all_reduce(total, group=group)
    base = torch.zeros_like(values) if before is None else before
    # a rank without real tokens (an all-padding microbatch) records 0 / 0: it weighs 0
    delta = torch.nan_to_num(values - base, nan=0.0)
    values.copy_(base + delta * (counts * group.size() / total.clamp(min=1)))


def _mtp_tracker_values() -> tuple[torch.Tensor, torch.Tensor] | None:
    tracker = MTPLossLoggingHelper.tracker
    if "loss_values" not in tracker:
        return None
    return tracker["loss_values"].clone(), tracker["total_values"].clone()


def _token_weight_mtp_loss(model, before: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Megatron averages each DP x CP rank's MTP loss (a mean over its own target tokens)
    over those ranks; weight this forward's contribution by the rank's share of the
    forward's target tokens first: the result is the mean over all of them (a rank
    without any, an all-padding microbatch, weighs 0)."""
    group = model.pg_collection.dp_cp
    after = _mtp_tracker_values()
    if after is None or group.size() == 1:
        return
    loss_before, count_before = (torch.zeros_like(v) for v in after) if before is None else before
    delta = torch.nan_to_num(after[0] - loss_before, nan=0.0)
    count = after[1] - count_before
    total = count.clone()
    torch.distributed.all_reduce(total, group=group)
    share = count * group.size() / total.clamp(min=1)
    MTPLossLoggingHelper.tracker["loss_values"].copy_(loss_before + delta * share)


def forward_microbatch(
    model,
    packed: PackedSequences,
    *,
    metrics_forward: bool = False,
    loss_mask_packed_local: torch.Tensor | None = None,
    tokens: step_metrics.TokenRows | None = None,
):
    """``model(**model_inputs(...))`` for one packed microbatch, in the step's mode
    (:func:`scoring_forward`): under ``metrics_reduction="step"`` the step's collector
    (:mod:`megascore.engine.outputs.step_metrics`) sees it, reading each token of ``tokens``
    (where the sequences' tokens are; None: each segment a sequence); else a metrics
    forward's z-loss and MTP losses are token-weighted over the ranks (:func:`_token_weight_z_loss`,
    :func:`_token_weight_mtp_loss`). Returns what the model returns (the
    :class:`OutputHead` on the last stage, the hidden states elsewhere)."""
    kwargs = model_inputs(
        model,
        packed,
        metrics_forward=metrics_forward,
        loss_mask_packed_local=loss_mask_packed_local,
    )
    collector = step_metrics.active(model) if metrics_forward else None
    if collector is not None:  # metrics_reduction "step": statistics, reduced at the end
        with collector.microbatch(packed, tokens), rope_positions(model, packed):
            return model(**kwargs)
    weigh = metrics_forward and bool(model.config.num_moe_experts)
    before = _z_loss_values() if weigh else None
    before = None if before is None else before.clone()
    weigh_mtp = metrics_forward and bool(model.config.mtp_num_layers)
    mtp_before = _mtp_tracker_values() if weigh_mtp else None
    with rope_positions(model, packed):
        output = model(**kwargs)
    if weigh:
        _token_weight_z_loss(model, packed, before)
    if weigh_mtp:
        _token_weight_mtp_loss(model, mtp_before)
    return output


def _read_moe_metrics(model, names: list[str], loss_scale: float) -> dict[str, float]:
    cfg = model.config
    # A router that saw no real token (an MTP layer of a step whose sequences all have
    # length 1: no position has a next token) records 0 / 0; it contributes 0 instead.
    for entry in get_moe_metrics_tracker().metrics.values():
        torch.nan_to_num_(entry.values, nan=0.0)
    writer = _ScalarCollector()
    get_moe_metrics_tracker().report(
        loss_scale=loss_scale,
        iteration=0,
        writer=writer,
        force_initialize=True,
        track_names=names,
        num_layers=cfg.num_layers,
        moe_layer_freq=cfg.moe_layer_freq,
        mtp_num_layers=cfg.mtp_num_layers,
        pg_collection=model.pg_collection,
    )
    return {name: writer.scalars[name] for name in names}


def _read_mtp_metrics(model, loss_scale: float) -> dict[str, float]:
    n = model.config.mtp_num_layers
    # Adding zeros creates the entries where this rank recorded nothing (other pipeline
    # stages too) and sets the same reduction group on every rank, so all of them join
    # the same all-reduces. Only the last pipeline stage holds the MTP layers.
    zero = torch.zeros((), device=next(model.parameters()).device)
    group = model.pg_collection.dp_cp
    # (each microbatch's losses were weighted by the rank's token share already:
    # forward_microbatch, so Megatron's average over the ranks is the token mean)
    MTPLossLoggingHelper.save_metrics_to_tracker(zero, zero, zero, 0, n, avg_group=group)
    writer = _ScalarCollector()
    MTPLossLoggingHelper.track_mtp_metrics(loss_scale, 0, writer)
    out = {}
    for i in range(1, n + 1):
        out[f"mtp_{i}_loss"] = writer.scalars[f"mtp_{i} loss"]
        out[f"mtp_{i}_acceptance_rate"] = writer.scalars[f"mtp_{i}_acceptance_rate"]
    return out


def _clear_trackers() -> None:
    """Fresh trackers: Megatron's keep their per-layer tensors, sized for the first model
    that recorded, so a later model with more layers (another checkpoint in the same
    process) would index past them."""
    destroy_moe_metrics_tracker()
    MTPLossLoggingHelper.tracker.clear()


def check_metrics_request(cfg, return_moe_metrics: bool, return_mtp_metrics: bool) -> None:
    """Raises ValueError for metrics the model cannot report (it has no such layers)."""
    if return_moe_metrics and not cfg.num_moe_experts:
        raise ValueError("MoE metrics requested from a dense model")
    if return_mtp_metrics and not cfg.mtp_num_layers:
        raise ValueError("MTP metrics requested from a model without MTP layers")


@dataclasses.dataclass
class ForwardMetrics:
    """MoE / MTP metrics of the forwards run inside :func:`scoring_forward` (filled on exit);
    ``sums`` what ``metrics_reduction="step"`` formed them from (None otherwise)."""

    moe: dict[str, float] = dataclasses.field(default_factory=dict)
    mtp: dict[str, float] = dataclasses.field(default_factory=dict)
    sums: MetricSums | None = None


@contextlib.contextmanager
def scoring_forward(
    model,
    *,
    return_moe_metrics: bool,
    return_mtp_metrics: bool,
    num_microbatches: int = 1,
    metrics_reduction: str = "step",
    data_parallel_split: bool = False,
):
    """The mode every scoring forward of one step runs in (see the module docstring).

    Without metrics: eval mode, no grad, MTP skipped. With metrics: one training-mode
    pass with grad enabled over the step's forwards (one per microbatch), then either

    * ``metrics_reduction="step"``: the statistics the routers and MTP layers saw over
      the whole step, reduced once (:mod:`megascore.engine.outputs.step_metrics`), or
    * ``"microbatch"``: Megatron's trackers, read as Megatron's ``training.py`` reads
      them (loss scale ``1 / num_microbatches``: the mean over microbatches);

    the trackers are cleared and the routers' buffers restored. Collective when metrics
    are requested (every rank, all stages).

    Args:
        model: the GPTModel of this rank.
        return_moe_metrics: compute the MoE aux-loss metrics (MoE models only).
        return_mtp_metrics: compute the MTP metrics (MTP models only).
        num_microbatches: forwards of the step run inside the block
            (:func:`forward_microbatch`).
        metrics_reduction: "step" or "microbatch" (above).
        data_parallel_split: the DP ranks score different sequences of the step
            ("step" sums their statistics; False: DP ranks score copies of one batch).

    Yields:
        A :class:`ForwardMetrics`, filled when the block exits without error.

    Raises:
        ValueError: see :func:`check_metrics_request`; an unknown ``metrics_reduction``.
    """
    check_metrics_request(model.config, return_moe_metrics, return_mtp_metrics)
    if metrics_reduction not in METRICS_REDUCTIONS:
        raise ValueError(f"metrics_reduction must be one of {METRICS_REDUCTIONS}")
    metrics = ForwardMetrics()
    if not (return_moe_metrics or return_mtp_metrics):
        with torch.no_grad(), _mtp_skipped(model):
            yield metrics
        return
    moe_names = moe_metric_names(model.config) if return_moe_metrics else []
    _clear_trackers()
    try:
        if metrics_reduction == "step":
            collector = step_metrics.StepMetrics(
                model,
                moe_names=moe_names,
                mtp=return_mtp_metrics,
                data_parallel_split=data_parallel_split,
            )
            with _training_forward(model), collector.recording():
                yield metrics
            metrics.sums = collector.reduce()
            metrics.moe, metrics.mtp = metrics.sums.values()
            return
        with _training_forward(model):
            yield metrics
        scale = 1.0 / num_microbatches
        if moe_names:
            metrics.moe = _read_moe_metrics(model, moe_names, scale)
        if return_mtp_metrics:
            metrics.mtp = _read_mtp_metrics(model, scale)
    finally:
        _clear_trackers()

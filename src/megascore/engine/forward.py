"""One packed GPTModel forward: the LM head's input plus the MoE / MTP metrics.

The pieces are what Megatron's schedule calls per microbatch
(:mod:`megascore.engine.pipeline`): :func:`model_inputs` builds the model's
arguments, :func:`scoring_forward` is the mode a whole step runs in (and reads the
metrics after it).

:func:`forward_microbatch` feeds a :class:`~megascore.engine.packing.PackedSequences` (THD,
this rank's CP shard) through the model and returns an :class:`OutputHead`: the
final hidden states (after the final layernorm) and the model's output layer,
which computes the vocab-parallel logits ``[C, V / tp]`` of any chunk of rows on
demand. The full ``[T_local, V / tp]`` logits are never materialised (they are
the classic OOM of prompt-logprob servers: 64k tokens x 128k vocabulary in fp32
is 32 GB); :func:`megascore.engine.logprobs.score_tokens` asks for one chunk of
``chunk_tokens`` rows at a time. The head comes from an ``output_processor`` hook
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
  step, reduced once (:mod:`megascore.engine.step_metrics`): the same for any layout
  and microbatch count; with DP > 1 each DP rank scores its own part of the step
  (:mod:`megascore.engine.data_parallel`) and the statistics are summed over them;
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
from collections.abc import Callable

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, gather_from_sequence_parallel_region
from megatron.core.transformer.moe.moe_logging import (
    destroy_moe_metrics_tracker,
    get_moe_metrics_tracker,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from megascore.config import METRICS_REDUCTIONS
from megascore.engine import step_metrics
from megascore.engine.packing import PackedSequences, cp_shard_indices, roll_within_segments
from megascore.engine.scratch import Scratch
from megascore.engine.segment_packing import full_positions, rope_positions
from megascore.model.batch_invariant import is_batch_invariant, pad_rows

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class OutputHead:
    """The LM head of one forward, applied to chunks of rows on demand.

    Attributes:
        hidden_states: ``[T_local, 1, H]`` final hidden states (after the final
            layernorm) of this rank's CP shard, in the model's dtype, detached. With
            sequence parallelism they were all-gathered over the TP group (the model
            hands over ``T_local / tp`` rows per rank), so every TP rank holds all rows.
        output_layer: the model's ``ColumnParallelLinear`` (``output_layer``).
        weight: the weight to pass to it: the shared word-embedding weight when
            embeddings are tied, None for the layer's own weight.
        scale_logits: the model's logit scaling (``GPTModel._scale_logits``, MuP).
        scratch: the buffers the head reuses (:func:`head_scratch`; None: new tensors).
    """

    hidden_states: torch.Tensor
    output_layer: torch.nn.Module
    weight: torch.Tensor | None
    scale_logits: Callable[[torch.Tensor], torch.Tensor]
    scratch: Scratch | None = None

    @property
    def num_tokens(self) -> int:
        """``T_local``: rows (packed positions of this CP shard)."""
        return self.hidden_states.shape[0]

    @property
    def vocab_local(self) -> int:
        """``V / tp``: logit columns of this TP rank (Megatron's ``VocabUtility`` slice)."""
        weight = self.output_layer.weight if self.weight is None else self.weight
        return weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.hidden_states.device

    def logits(self, start: int, end: int) -> torch.Tensor:
        """Vocab-parallel logits of rows ``[start, end)``, as Megatron's forward computes them.

        Memory is ``(end - start) x V / tp`` in the model's dtype: callers bound it by
        asking for chunks.

        Args:
            start: first row.
            end: one past the last row.

        Returns:
            ``[end - start, V / tp]`` in the model's dtype; row ``t`` predicts the token
            after packed position ``start + t``.
        """
        # rows: [C, 1, H]; already gathered over TP, so the layer must not gather again
        rows = self.hidden_states[start:end]
        layer = self.output_layer
        if self.scratch is not None and _plain_matmul(layer):
            # what the layer computes (a forward-only ColumnParallelLinear without bias is
            # ``matmul(input, weight.t())``), written into the reused buffer
            weight = layer.weight if self.weight is None else self.weight
            return self.scale_logits(self.matmul(rows[:, 0], weight))
        saved = layer.sequence_parallel
        layer.sequence_parallel = False
        try:
            with torch.no_grad():
                logits, _ = layer(rows, weight=self.weight, runtime_gather_output=False)
        finally:
            layer.sequence_parallel = saved
        return self.scale_logits(logits).squeeze(1)  # [C, V / tp]

    def matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``matmul(x, weight.t())`` for rows ``x [C, H]`` and ``weight [V/tp, H]``: padded
        like the output layer's matmuls when it is batch-invariant
        (:mod:`megascore.model.batch_invariant`), written into the head's reused buffer
        (a new tensor without one). Returns ``[C, V/tp]``."""
        padded = pad_rows(x) if is_batch_invariant(self.output_layer) else x
        if self.scratch is None:
            return torch.matmul(padded, weight.t())[: len(x)]
        out = self.scratch.take("logits", len(padded), weight.shape[0], x.dtype, x.device)
        return torch.matmul(padded, weight.t(), out=out)[: len(x)]


def _plain_matmul(layer: torch.nn.Module) -> bool:
    """Whether the output layer's forward is a plain ``matmul(input, weight.t())``: Megatron's
    local ``ColumnParallelLinear`` (not TransformerEngine's) without a bias; with TP > 1 its
    forward only marks the input for the backward, and the rows were gathered already."""
    return type(layer) is ColumnParallelLinear and layer.bias is None


def head_scratch(output_layer: torch.nn.Module) -> Scratch:
    """The head's reused buffers (:mod:`megascore.engine.scratch`), kept on the model's
    output layer: they live as long as the model."""
    scratch = output_layer.__dict__.get("_megascore_scratch")
    if scratch is None:
        scratch = output_layer.__dict__["_megascore_scratch"] = Scratch()
    return scratch


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


def packed_position_ids(
    cu_seqlens_padded: torch.Tensor, cp_rank: int, cp_size: int, params=None
) -> torch.Tensor:
    """Position of every token in its sequence, CP-sharded.

    Args:
        cu_seqlens_padded: ``[B+1]`` padded boundaries.
        cp_rank: this rank in the CP group.
        cp_size: CP group size.
        params: the packing's ``PackedSeqParams``: positions of segments that continue
            a shared prefix continue from it
            (:class:`megascore.engine.segment_packing.SharedPrefixParams`).

    Returns:
        int64 ``[1, T / cp_size]`` (positions restart at 0 for every sequence).
    """
    cu = cu_seqlens_padded.to("cpu", torch.long)
    pos = full_positions(cu, params)
    return pos[cp_shard_indices(cu, cp_rank, cp_size)].unsqueeze(0)


def _position_and_length(packed: PackedSequences) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[T]`` pairs over the full packed axis: position inside the padded
    segment and the real length of the segment's sequence."""
    cu = packed.cu_seqlens.to("cpu", torch.long)
    cu_pad = packed.cu_seqlens_padded.to("cpu", torch.long)
    seg = cu_pad[1:] - cu_pad[:-1]
    pos = torch.arange(int(cu_pad[-1])) - torch.repeat_interleave(cu_pad[:-1], seg)
    return pos, torch.repeat_interleave(cu[1:] - cu[:-1], seg)


def packed_labels_and_mask(packed: PackedSequences, cp_rank: int, cp_size: int):
    """Next-token targets and Megatron's loss mask for this CP shard.

    Targets are rolled by -1 inside each padded segment on the full packed axis,
    then sharded like the inputs. The mask is Megatron's (aligned with the
    targets): 1 where the target of position ``t`` is a real token of the same
    sequence (``t + 1 < length``).

    Args:
        packed: the packed batch (full ``input_ids`` and boundaries are used).
        cp_rank: this rank in the CP group.
        cp_size: CP group size.

    Returns:
        ``(labels int64 [1, T_local], loss_mask float32 [1, T_local])``.
    """
    cu_pad = packed.cu_seqlens_padded.to("cpu")
    idx = cp_shard_indices(cu_pad, cp_rank, cp_size)
    ids = packed.input_ids.to("cpu", torch.long)
    labels = roll_within_segments(ids, cu_pad, shifts=-1)[:, idx]
    pos, length = _position_and_length(packed)
    return labels, (pos + 1 < length)[idx][None].float()


def packed_padding_mask(packed: PackedSequences, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Megatron's MoE ``padding_mask`` for this CP shard: bool ``[1, T_local]``, True at the
    pad positions of each padded segment (position >= the sequence's real length)."""
    pos, length = _position_and_length(packed)
    idx = cp_shard_indices(packed.cu_seqlens_padded.to("cpu"), cp_rank, cp_size)
    return (pos >= length)[idx][None]


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


def _head_processor(*, hidden_states, output_layer, output_weight, scale_logits, **_):
    """GPTModel ``output_processor``: hands over the head instead of computing logits.

    ``hidden_states`` is ``[s, 1, H]`` after the final layernorm (and, with MTP, the
    main model's share of the MTP block's output); with sequence parallelism ``s`` is
    this rank's ``T_local / tp`` rows, gathered here over TP once (``T_local x H``).
    """
    hidden = hidden_states.detach()
    if output_layer.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=False, group=output_layer.tp_group
        )
    return OutputHead(
        hidden_states=hidden,
        output_layer=output_layer,
        weight=None if output_weight is None else output_weight.detach(),
        scale_logits=scale_logits,
        scratch=head_scratch(output_layer),
    )


def router_token_counts(model, packed: PackedSequences):
    """Real tokens the router of each MoE-capable layer sees on this rank.

    Decoder layers see this rank's share of the real tokens (its CP shard; with sequence
    parallelism its TP slice of that: :func:`megascore.engine.step_metrics.router_rows`);
    MTP layer k sees the positions whose token k ahead is real (``position + k < length``).

    Returns:
        float32 ``[num_layers + mtp_num_layers]``.
    """
    cfg = model.config
    pos, length = _position_and_length(packed)
    rows = step_metrics.router_rows(model, packed)
    pos, length = pos[rows], length[rows]
    counts = [float((pos < length).sum())] * cfg.num_layers
    counts += [float((pos + k < length).sum()) for k in range(1, (cfg.mtp_num_layers or 0) + 1)]
    return torch.tensor(counts)


def _cp_rank_size(model) -> tuple[int, int]:
    """This rank's (CP rank, CP size) in the model's context-parallel group."""
    cp = model.pg_collection.cp
    return (cp.rank(), cp.size()) if cp.size() > 1 else (0, 1)


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
):
    """``model(**model_inputs(...))`` for one packed microbatch, in the step's mode
    (:func:`scoring_forward`): under ``metrics_reduction="step"`` the step's collector
    (:mod:`megascore.engine.step_metrics`) sees it; else a metrics forward's z-loss and
    MTP losses are token-weighted over the ranks (:func:`_token_weight_z_loss`,
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
        with collector.microbatch(packed):
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


def model_inputs(
    model,
    packed: PackedSequences,
    *,
    metrics_forward: bool = False,
    loss_mask_packed_local: torch.Tensor | None = None,
) -> dict:
    """Keyword arguments of ``model(...)`` for this rank's shard of a packed batch.

    Every pipeline stage passes the same inputs (the first embeds ``input_ids``; the
    last needs them for MTP); the output processor hands over the :class:`OutputHead`.

    Args:
        model: the GPTModel.
        packed: the batch, packed for this rank's CP rank.
        metrics_forward: a forward that records MoE / MTP metrics: MoE models get
            Megatron's ``padding_mask`` (pads stay out of the router statistics), MTP
            models the MTP ``labels`` and ``loss_mask``.
        loss_mask_packed_local: ``[1, T_local]`` Megatron-style loss mask for the MTP
            metrics, CP-sharded; None: every target that is a real token of its sequence.

    Returns:
        The keyword arguments.
    """
    cp_rank, cp_size = _cp_rank_size(model)
    device = next(model.parameters()).device
    p = packed.packed_seq_params
    kwargs = dict(
        input_ids=packed.input_ids_cp_sharded.to(device, torch.long),  # [1, T_local]
        position_ids=packed_position_ids(packed.cu_seqlens_padded, cp_rank, cp_size, p).to(device),
        attention_mask=None,
        packed_seq_params=dataclasses.replace(
            p,
            cu_seqlens_q=p.cu_seqlens_q.to(device),
            cu_seqlens_kv=p.cu_seqlens_kv.to(device),
            cu_seqlens_q_padded=p.cu_seqlens_q_padded.to(device),
            cu_seqlens_kv_padded=p.cu_seqlens_kv_padded.to(device),
        ),
        output_processor=_head_processor,
    )
    cfg = model.config
    if metrics_forward and cfg.num_moe_experts:
        padding_mask = packed_padding_mask(packed, cp_rank, cp_size)  # [1, T_local]
        tp = model.pg_collection.tp
        if cfg.sequence_parallel and not model.pre_process and tp.size() > 1:
            # GPTModel scatters the mask to the sequence-parallel region only on the first
            # pipeline stage; later stages get this rank's contiguous slice from here.
            per = padding_mask.shape[1] // tp.size()
            padding_mask = padding_mask[:, tp.rank() * per : (tp.rank() + 1) * per]
        kwargs.update(padding_mask=padding_mask.to(device))
    if metrics_forward and cfg.mtp_num_layers:
        labels, loss_mask = packed_labels_and_mask(packed, cp_rank, cp_size)
        if loss_mask_packed_local is not None:
            loss_mask = loss_mask_packed_local.reshape(1, -1).float()
        kwargs.update(labels=labels.to(device), loss_mask=loss_mask.to(device))
    return kwargs


@dataclasses.dataclass
class ForwardMetrics:
    """MoE / MTP metrics of the forwards run inside :func:`scoring_forward` (filled on exit)."""

    moe: dict[str, float] = dataclasses.field(default_factory=dict)
    mtp: dict[str, float] = dataclasses.field(default_factory=dict)


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
      the whole step, reduced once (:mod:`megascore.engine.step_metrics`), or
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
            metrics.moe, metrics.mtp = collector.reduce()
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

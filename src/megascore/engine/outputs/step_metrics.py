"""Step-level MoE / MTP metrics: Megatron's formulas over the whole step, reduced once.

Megatron computes each aux loss per microbatch (and per rank group) and reports the
mean over the microbatches, so its values move with the microbatch count, which the
server chose, not the user (``metrics_reduction="microbatch"``,
:func:`megascore.engine.schedule.forward.scoring_forward`). The default,
``metrics_reduction="step"``, collects the *sufficient statistics* of every formula
over all microbatches and ranks of the step and applies the formula once:

* a hook on every router's ``TopKRouter.routing`` (per instance, for the metrics
  forward only) reads the router logits of each call and adds, per MoE layer: per
  expert, the tokens routed there and the sum of their routing scores (Megatron's
  ``compute_routing_scores_for_aux_loss``: the aux-loss top-k, without expert bias),
  the token count and the sum of the squared ``logsumexp`` of the logits (float64);
  the same counts per *sequence*. The tokens are those of the dense batch
  (:class:`TokenRows`): every real token of every sequence, read at the row that
  computes it, so a row of a shared prefix counts once per sequence it stands for; MTP
  layer ``d`` sees the positions whose token ``d`` ahead is real (Megatron's rolled
  padding mask), read in the segment that holds the tokens up to ``p + d + 1``
  (:mod:`megascore.engine.layout.prefix_tree`: with ``k`` MTP layers continuations repeat
  ``1 + k`` rows of their prefix);
* per microbatch, the change of Megatron's MTP tracker gives each MTP layer's summed
  token losses (its masked mean times its token count), accepted and counted tokens;
  the loss mask is a weight (:mod:`megascore.engine.layout.microbatch`: the sequences whose
  scored token a row predicts) and the acceptance counts weigh by it
  (:func:`_weighted_acceptance_counts`; a 0 / 1 mask gives Megatron's counts);
* at the end of the step (:meth:`StepMetrics.reduce`) the statistics are summed over
  the ranks that hold different tokens (sequence-parallel TP slices, CP shards, the
  DP ranks when they score different sequences, the PP stages' layers) and counted
  once where ranks hold copies (TP ranks without sequence parallelism, DP ranks that
  score the same batch, TP ranks of the MTP losses) into a
  :class:`megascore.api.metric_sums.MetricSums`, which applies, per layer ``l`` with ``T``
  real tokens, ``c_i`` tokens and ``P_i`` summed scores at expert ``i`` (``E``
  experts, top-``k``):

  - ``load_balancing_loss_l = E / (k T^2) * sum_i c_i P_i`` (``switch_load_balancing_
    loss_func`` on the whole step);
  - ``global_load_balancing_loss_l``: the same (the step is Megatron's global batch);
  - ``seq_load_balancing_loss_l``: the mean over the step's sequences (the request's
    sequences, not the packed microbatches) of the same formula on each sequence's
    own tokens; a sequence without a token at the layer (an MTP layer of a length-1
    sequence) is left out;
  - ``z_loss_l = sum(logsumexp(logits)^2) / T``;

  and the reported value is Megatron's ``sum_l value_l / num_moe_layers``
  (``MoEMetricsTracker.report``; a layer without real tokens adds 0). MTP:
  ``mtp_i_loss`` = summed token losses / counted tokens, ``mtp_i_acceptance_rate`` =
  100 x accepted / counted.

The values are therefore the same for any TP / CP / EP / PP layout and microbatch
count (``tests/unit/test_step_metrics.py``, ``tests/distributed``), and the sums of the
steps of one request add up to the request's (the server's batcher adds them), so its
metrics do not depend on how it was cut into steps either.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from megatron.core.transformer import multi_token_prediction
from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker
from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from megascore.api import layout
from megascore.api.metric_sums import MetricSums
from megascore.engine.layout.packing import PackedSequences, cp_shard_indices

_ACTIVE: dict[int, StepMetrics] = {}  # id(model) -> its collector during a metrics step
_MTP_KEYS = ("loss_values", "correct_values", "total_values")


def router_rows(model, packed: PackedSequences) -> torch.Tensor:
    """Packed positions (on the full packed axis of ``packed``) whose rows this rank's
    routers see, in router order: this rank's CP shard and, with sequence parallelism,
    its TP rank's contiguous ``1 / tp`` slice of it. int64 ``[rows]`` on the CPU."""
    cp = model.pg_collection.cp
    cu_pad = packed.cu_seqlens_padded.to("cpu", torch.long)
    rows = cp_shard_indices(cu_pad, cp.rank(), cp.size())
    tp = model.pg_collection.tp
    if model.config.sequence_parallel and tp.size() > 1:
        per = rows.numel() // tp.size()
        rows = rows[tp.rank() * per : (tp.rank() + 1) * per]
    return rows


@dataclasses.dataclass(frozen=True)
class TokenRows:
    """Where a microbatch's tokens are computed.

    Attributes:
        positions: int64 ``[T_mb]`` (CPU) the packed row (full axis) of each token of the
            microbatch's sequences, in their order (rows of a shared prefix repeat).
        lengths: int64 ``[B_mb]`` (CPU) the sequences' lengths.
    """

    positions: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def dense(cls, packed: PackedSequences) -> TokenRows:
        """Every packed segment one sequence of its real tokens."""
        real = packed.cu_seqlens.to("cpu", torch.long).diff()
        starts = packed.cu_seqlens_padded.to("cpu", torch.long)[:-1]
        first = torch.repeat_interleave(torch.from_numpy(layout.offsets(real.numpy())[:-1]), real)
        rows = torch.arange(int(real.sum())) - first + torch.repeat_interleave(starts, real)
        return cls(rows, real)

    def at_depth(self, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, sequences)`` int64 ``[n]``: the tokens ``p`` with a real token ``depth``
        ahead, each at the row of its position in the segment that holds the tokens up to
        ``p + depth + 1`` (the last token's at the end), and their sequences."""
        count = self.lengths.numel()
        seq = torch.repeat_interleave(torch.arange(count), self.lengths)
        first = torch.from_numpy(layout.offsets(self.lengths.numpy())[:-1])[seq]
        pos = torch.arange(self.positions.numel()) - first
        length = self.lengths[seq]
        keep = pos + depth < length
        ahead = torch.minimum(pos + depth + 1, length - 1)
        rows = self.positions[(first + ahead)[keep]] - (ahead - pos)[keep]
        return rows, seq[keep]


def active(model) -> StepMetrics | None:
    """The collector of ``model``'s metrics step in progress (None outside one)."""
    return _ACTIVE.get(id(model))


class StepMetrics:
    """Sufficient statistics of one step's MoE / MTP metrics on this rank (module docstring).

    Args:
        model: this rank's GPTModel (one stage).
        moe_names: MoE metrics to report
            (:func:`megascore.engine.schedule.forward.moe_metric_names`).
        mtp: report the MTP metrics.
        data_parallel_split: the DP ranks score different sequences of the step (their
            statistics are summed); False: every DP rank scores the same batch (counted
            once).
    """

    def __init__(self, model, *, moe_names: list[str], mtp: bool, data_parallel_split: bool):
        cfg = model.config
        self.model = model
        self.moe_names = list(moe_names)
        self.want_mtp = mtp
        self.data_parallel_split = data_parallel_split
        self.experts = cfg.num_moe_experts or 0
        self.layers = cfg.num_layers + (cfg.mtp_num_layers or 0)  # Megatron's tracker slots
        self.device = next(model.parameters()).device
        f64 = dict(dtype=torch.float64, device=self.device)
        # per layer: tokens per expert [E] | scores per expert [E] | real tokens | sum lse^2
        self.tokens = torch.zeros(self.layers, 2 * self.experts + 2, **f64)
        # per microbatch: [layers, sequences, 2E + 1] (tokens, scores per expert; tokens)
        self.sequences: list[torch.Tensor] = []
        # per MTP layer: summed token losses, accepted, counted
        self.mtp = torch.zeros(3, cfg.mtp_num_layers or 0, **f64)
        self._depths: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._num_rows = 0
        if self.moe_names and cfg.mtp_use_repeated_layer:
            raise ValueError("metrics_reduction 'step' does not support mtp_use_repeated_layer")

    # ---- recording ------------------------------------------------------------------------

    @contextlib.contextmanager
    def recording(self):
        """Hooks the routers (when MoE metrics are wanted) and makes this the model's
        active collector (:func:`active`) for the block."""
        routers = []
        if self.moe_names:
            routers = [m for m in self.model.modules() if isinstance(m, TopKRouter)]
        for router in routers:
            router.routing = self._hooked(router)
        _ACTIVE[id(self.model)] = self
        counts = multi_token_prediction._compute_mtp_acceptance_counts
        multi_token_prediction._compute_mtp_acceptance_counts = _weighted_acceptance_counts
        try:
            yield self
        finally:
            multi_token_prediction._compute_mtp_acceptance_counts = counts
            _ACTIVE.pop(id(self.model), None)
            for router in routers:
                del router.routing  # the class's method again

    def _hooked(self, router):
        routing = router.routing

        def hooked(logits, padding_mask=None):
            self._record_router(router, logits, padding_mask)
            return routing(logits, padding_mask=padding_mask)

        return hooked

    @contextlib.contextmanager
    def microbatch(self, packed: PackedSequences, tokens: TokenRows | None = None):
        """Around one microbatch's forward: where each token's router rows are (``tokens``;
        None: :meth:`TokenRows.dense`), and the MTP tracker's change for the MTP
        statistics."""
        tokens = TokenRows.dense(packed) if tokens is None else tokens
        rows = router_rows(self.model, packed)
        local = torch.full((int(packed.cu_seqlens_padded[-1]),), -1, dtype=torch.long)
        local[rows] = torch.arange(rows.numel())
        self._num_rows = rows.numel()
        self._depths = []
        for depth in range(1 + (self.model.config.mtp_num_layers or 0)):
            at, seq = tokens.at_depth(depth)
            mine = local[at] >= 0  # the tokens this rank's routers see
            self._depths.append((local[at][mine].to(self.device), seq[mine].to(self.device)))
        self.sequences.append(
            torch.zeros(self.layers, tokens.lengths.numel(), 2 * self.experts + 1,
                        dtype=torch.float64, device=self.device)
        )  # fmt: skip
        before = self._mtp_tracker()
        try:
            yield
        finally:
            self._depths = None
        if self.want_mtp:
            after = self._mtp_tracker()
            loss, correct, total = (a - b for a, b in zip(after, before, strict=True))
            # Megatron's logged loss is the masked mean over the layer's counted tokens
            self.mtp += torch.stack([loss * total, correct, total])

    def _mtp_tracker(self) -> list[torch.Tensor]:
        tracker = MTPLossLoggingHelper.tracker
        if "loss_values" not in tracker:
            return [torch.zeros_like(self.mtp[0]) for _ in _MTP_KEYS]
        return [tracker[k].detach().to(self.mtp).clone() for k in _MTP_KEYS]

    def _record_router(self, router, logits: torch.Tensor, padding_mask) -> None:
        if self._depths is None:
            raise RuntimeError("a router ran outside a metrics microbatch")
        layer = router.layer_number - 1
        depth = router.layer_number if router.is_mtp_layer else 0
        if router.is_mtp_layer:
            layer += self.model.config.num_layers
        with torch.no_grad():
            logits = logits.detach().reshape(-1, self.experts)  # [rows, E]
            if logits.shape[0] != self._num_rows:
                raise RuntimeError(
                    f"router of layer {layer + 1}: {logits.shape[0]} rows, "
                    f"expected {self._num_rows}"
                )
            pad = None if padding_mask is None else padding_mask.reshape(-1)
            routed, scores = compute_routing_scores_for_aux_loss(
                logits, router.topk, router.score_function, fused=False, padding_mask=pad
            )
            rows, seq = self._depths[depth]
            ones = torch.ones_like(rows, dtype=torch.float64)[:, None]
            per_token = torch.cat([routed[rows].double(), scores[rows].double(), ones], dim=1)
            lse2 = torch.logsumexp(logits[rows].double(), dim=-1).square()
            self.tokens[layer] += torch.cat([per_token.sum(0), lse2.sum()[None]])
            self.sequences[-1][layer].index_add_(0, seq, per_token)

    # ---- reduction ------------------------------------------------------------------------

    def reduce(self) -> MetricSums:
        """The step's metric sums, the same on every rank (collective over all of them);
        :meth:`MetricSums.values` gives the metrics."""
        pgs = self.model.pg_collection
        tp, cp, dp = pgs.tp, pgs.cp, pgs.dp
        tp_copies = tp.size() > 1 and not self.model.config.sequence_parallel
        dp_copy = dp.size() > 1 and not self.data_parallel_split and dp.rank() > 0
        seq_loss = self._sequence_losses(tp_copies)
        keep_tokens = not (dp_copy or (tp_copies and tp.rank() > 0))
        keep_seq = not dp_copy and tp.rank() == 0 and cp.rank() == 0
        keep_mtp = not dp_copy and tp.rank() == 0  # TP ranks compute the same MTP losses
        flat = torch.cat(
            [
                (self.tokens * keep_tokens).flatten(),
                (seq_loss * keep_seq).flatten(),
                (self.mtp * keep_mtp).flatten(),
            ]
        )
        for group in (pgs.tp_dp_cp, pgs.pp):
            if group.size() > 1:
                dist.all_reduce(flat, group=group)
        tokens, seq_loss, mtp = (
            part.view_as(like).cpu().numpy()
            for part, like in zip(
                flat.split([self.tokens.numel(), seq_loss.numel(), self.mtp.numel()]),
                (self.tokens, seq_loss, self.mtp),
                strict=True,
            )
        )
        cfg = self.model.config
        return MetricSums(
            tokens=tokens,
            sequences=seq_loss,
            mtp=mtp,
            topk=cfg.moe_router_topk,
            # Megatron's count of MoE layers (the mean it reports divides by it)
            moe_layers=MoEMetricsTracker._count_moe_layers(
                cfg.num_layers, cfg.moe_layer_freq, cfg.mtp_num_layers
            ),
            moe_names=tuple(self.moe_names),
            want_mtp=self.want_mtp,
        )

    def _sequence_losses(self, tp_copies: bool) -> torch.Tensor:
        """``[2, layers]``: per layer, the summed per-sequence aux losses of this rank's
        sequences and how many sequences had a token there (the sequences' statistics
        summed over the ranks that hold slices of them: TP with SP, CP)."""
        E, k = self.experts, self.model.config.moe_router_topk
        out = torch.zeros(2, self.layers, dtype=torch.float64, device=self.device)
        if "seq_load_balancing_loss" not in self.moe_names:
            return out
        seqs = torch.cat(self.sequences, dim=1)  # [layers, S, 2E + 1]
        pgs = self.model.pg_collection
        if tp_copies and pgs.tp.rank() > 0:
            seqs.zero_()
        if pgs.tp_cp.size() > 1:
            dist.all_reduce(seqs, group=pgs.tp_cp)
        counts, scores, n = seqs[..., :E], seqs[..., E : 2 * E], seqs[..., 2 * E]
        loss = (counts * scores).sum(-1) * E / (k * n.clamp(min=1).square())  # [layers, S]
        out[0] = loss.sum(-1)
        out[1] = (n > 0).sum(-1)
        return out


def _weighted_acceptance_counts(
    mtp_logits, mtp_labels, loss_mask, output_layer, runtime_gather_output, tp_group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``_compute_mtp_acceptance_counts`` with the loss mask as a weight:
    ``(sum of weights where the MTP argmax is the label, sum of weights)``."""
    mtp = multi_token_prediction
    with torch.no_grad():
        size = dist.get_world_size(group=tp_group) if tp_group is not None else 1
        if size > 1 and mtp._mtp_logits_are_vocab_sharded(output_layer, runtime_gather_output):
            preds = mtp._vocab_parallel_argmax(mtp_logits, tp_group, size)
        else:
            preds = torch.argmax(mtp_logits, dim=-1)  # [s, b]
        weights = loss_mask.transpose(0, 1).float()  # [b, s] -> [s, b]
        correct = ((preds == mtp_labels.transpose(0, 1)) * weights).sum()
        return correct.float(), weights.sum().float()

"""Data-parallel ranks share a step: each scores its own part of the batch.

The ranks outside TP x CP x PP are data-parallel (``DP = world / (TP x CP x PP)``;
expert parallelism is carved out of DP x CP, so under EP the extra ranks are DP
ranks). Every rank receives the whole batch (``megascore.engine.ranks.protocol``); then

1. every rank computes the same split (:func:`split_step`, no communication): the step
   is cut into microbatches as a lone replica would cut it, and each microbatch's
   sequences go to the DP ranks balanced by padded tokens (longest first, each to the
   least loaded rank), each part in the caller's order. With prefix sharing on, the
   units are the groups of sequences that share a prefix (a group stays on one DP
   rank, which computes its prefix once; balanced by the rows of its segments), each
   part group after group. Every DP rank runs the *same
   number* of microbatches of the *same* packed length (the largest share; a DP rank
   without sequences in a microbatch runs one of pad tokens only, a DP rank without
   any sequence only those), because the expert layers' token dispatch is a
   collective over the EP group whose calls must pair up and whose shapes must agree
   (Megatron's allgather dispatcher);
2. each DP rank's TP x CP x PP group runs :func:`megascore.engine.schedule.step.run_step` on its
   part (every rank of the replica agrees on the outcome, as before);
3. the output rank of every DP group (its first pipeline stage's TP 0 / CP 0 rank)
   turns its part into a :class:`~megascore.api.types.ScoreOutput`
   (:func:`megascore.engine.schedule.step_output.finish_step`) and sends it, typed (shapes derived
   from the batch on both sides, nothing pickled), to global rank 0 over a gloo group of
   the output ranks; rank 0 joins the parts in the caller's order
   (:func:`megascore.api.selection.concat_outputs`).

Metrics stay those of one rank scoring the whole batch. Step-level metrics (the default,
:mod:`megascore.engine.outputs.step_metrics`) sum every DP rank's statistics
(``StepConfig.data_parallel_split``). Megatron's per-microbatch metrics
(``metrics_reduction="microbatch"``): microbatch ``i`` of every DP rank together is the
lone rank's microbatch ``i``, and

* the aux losses (``load_balancing_loss``, ``seq_load_balancing_loss``) are computed by
  Megatron from expert token counts summed over the TP x CP group; during a metrics
  step of a split batch the routers sum them over TP x DP x CP instead
  (:func:`aux_losses_over_data_parallel`): each rank contributes its own tokens'
  probabilities against the whole batch's counts, the tracker sums those over the same
  group, so the value is the one of the whole batch (``global_load_balancing_loss``
  already reduces over TP x DP x CP);
* ``z_loss`` and the MTP losses are token-weighted means over the DP ranks
  (``megascore.engine.schedule.forward``), acceptance rates sum their counts over DP;
* pad tokens (including whole all-padding microbatches) are masked out of all of them.

Every DP rank's metrics are then equal; rank 0 reports its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter

from megascore.api import layout, schema, selection
from megascore.api.errors import WorkerLostError
from megascore.api.types import ScoreBatch, ScoreOutput
from megascore.engine.layout.microbatch_plan import (
    MicrobatchPlan,
    MicrobatchSegments,
    SharedUnits,
    joined_groups,
    shared_units,
    split_microbatches,
)
from megascore.engine.schedule.step import (
    StepConfig,
    StepGroups,
    lead_rows,
    run_step,
    shared_prefix,
    token_keys,
)
from megascore.engine.schedule.step_output import finish_step

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepSplit:
    """One step's sequences across the DP ranks (the same on every rank).

    Attributes:
        parts: per DP rank, int64 indices of its sequences (ascending: caller's order).
        plans: per DP rank, its
            :class:`~megascore.engine.layout.microbatch_plan.MicrobatchPlan` (ranges into its
            part; every plan has as many ranges and the same ``pad_to``).
    """

    parts: list[np.ndarray]
    plans: list[MicrobatchPlan]


def balanced_parts(padded: np.ndarray, size: int) -> list[np.ndarray]:
    """Sequences to ``size`` ranks balanced by tokens: longest first, each to the least
    loaded rank (ties to the lowest rank); every part ascending."""
    load = np.zeros(size, dtype=np.int64)
    owner = np.empty(padded.size, dtype=np.int64)
    for i in np.argsort(-padded, kind="stable"):
        rank = int(np.argmin(load))
        owner[i] = rank
        load[rank] += padded[i]
    return [np.flatnonzero(owner == rank) for rank in range(size)]


def split_step(
    lengths: np.ndarray,
    size: int,
    pad_multiple: int,
    microbatches: int,
    shared: SharedUnits | None = None,
) -> StepSplit:
    """Splits a step's sequences across ``size`` DP ranks (module docstring, 1).

    The step is cut into microbatches as one rank would cut it
    (:func:`~megascore.engine.layout.microbatch_plan.split_microbatches` of its sequences, or of its
    groups sharing a prefix); each microbatch's sequences (groups) are then shared out
    (:func:`balanced_parts`), so microbatch ``i`` of every DP rank together is the lone
    rank's microbatch ``i``, and a group's prefix is computed once, by one DP rank.

    Args:
        lengths: int64 ``[B]`` sequence lengths of the step.
        size: data-parallel ranks.
        pad_multiple: per-sequence pad multiple.
        microbatches: microbatches wanted (fewer when the step is small).
        shared: the step's groups sharing a prefix
            (:func:`~megascore.engine.layout.microbatch_plan.shared_units`), or None for a
            dense step.

    Returns:
        The :class:`StepSplit` (dense: every part ascending, the caller's order; shared:
        group after group).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if shared is None:
        units = [np.array([i], dtype=np.int64) for i in range(lengths.size)]
        costs = layout.padded_lengths(lengths, pad_multiple)
    else:
        units, costs = shared.groups, shared.costs
    parts: list[list[np.ndarray]] = [[] for _ in range(size)]
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(size)]
    segments: list[list[MicrobatchSegments]] = [[] for _ in range(size)]
    counts, pad_to = [0] * size, 0
    for a, b in split_microbatches(costs, pad_multiple, microbatches)[0]:
        for rank, share in enumerate(balanced_parts(costs[a:b], size)):
            seqs = [units[a + int(i)] for i in share]
            n = sum(s.size for s in seqs)
            if shared is not None:  # the groups' layouts, numbered like the part's sequences
                mb = joined_groups(shared, lengths, share + a)
                numbered = np.arange(counts[rank], counts[rank] + n, dtype=np.int64)
                segments[rank].append(MicrobatchSegments(numbered, mb.segments))
            parts[rank] += seqs
            ranges[rank].append((counts[rank], counts[rank] + n))
            counts[rank] += n
            pad_to = max(pad_to, int(costs[a:b][share].sum()))
    return StepSplit(
        parts=[np.concatenate([np.zeros(0, np.int64), *p]).astype(np.int64) for p in parts],
        plans=[
            MicrobatchPlan(ranges=r, pad_to=pad_to, segments=None if shared is None else s)
            for r, s in zip(ranges, segments, strict=True)
        ],
    )


def sub_batch(batch: ScoreBatch, seq_idx: np.ndarray, block: int = 0) -> ScoreBatch:
    """The batch of sequences ``seq_idx`` (same options and, with the prefix cache's
    ``block``, their part of a cache plan; may hold no sequence)."""
    lengths = np.asarray(batch.lengths)
    tokens = layout.token_index(lengths, seq_idx)
    rows = {schema.TOKEN: tokens, schema.SEQUENCE: seq_idx}
    inputs = {
        i.name: np.asarray(getattr(batch, i.name))[rows[i.per]]
        for i in schema.INPUTS
        if getattr(batch, i.name) is not None
    }
    if batch.cache_slots is not None:  # the blocks of cache_hits + length, per sequence
        hits = np.asarray(batch.cache_hits, np.int64)
        blocks = -(-(hits + lengths) // block)
        inputs["cache_hits"] = hits[seq_idx]
        inputs["cache_slots"] = np.asarray(batch.cache_slots)[layout.token_index(blocks, seq_idx)]
    token_ids = np.asarray(batch.token_ids)[tokens]
    return dataclasses.replace(batch, token_ids=token_ids, lengths=lengths[seq_idx], **inputs)


@contextlib.contextmanager
def aux_losses_over_data_parallel(model, enabled: bool):
    """The routers' TP x CP group becomes TP x DP x CP for the block (module docstring).

    In Megatron-Core 0.19 ``TopKRouter.tp_cp_group`` is read by the aux losses (token
    counts and the tracker's sum), the z-loss coefficient (which the tracker divides out
    again) and quantile routing (refused by megascore's routing checks for metrics).
    """
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)] if enabled else []
    saved = [router.tp_cp_group for router in routers]
    for router in routers:
        router.tp_cp_group = router.tp_dp_cp_group
    try:
        yield
    finally:
        for router, group in zip(routers, saved, strict=True):
            router.tp_cp_group = group


def _output_fields(batch: ScoreBatch, routing_dims: tuple[int, int] | None):
    """``(output, key, dtype, shape)`` of every array of a part's output, in sending order
    (the wanted outputs of :data:`megascore.api.schema.OUTPUTS`; ``key`` names an entry of a
    map output, else None)."""
    rows = {schema.TOKEN: batch.num_tokens, schema.SEQUENCE: batch.num_sequences}
    fields = []
    for out in schema.OUTPUTS:
        if not out.wanted(batch):
            continue
        if out.dims is not None:
            dims = schema.flat_dims(out, batch)
        elif batch.routing is not None:  # set by the data: the routing's [L, k]
            dims = tuple(np.shape(batch.routing)[1:])
        else:
            dims = tuple(routing_dims or ())
        shape = (rows[out.per], *dims)
        # a map's keys sorted: rank 0 holds the request's order (losses=("nll", "mean_nll")),
        # the other ranks the broadcast's (the loss bitmask's)
        keys = (None,) if out.keys is None else tuple(sorted(out.keys(batch)))
        fields += [(out.name, key, np.dtype(out.dtype), shape) for key in keys]
    return fields


def send_output(out: ScoreOutput, batch: ScoreBatch, routing_dims, group, dst: int) -> None:
    """Sends a part's output to ``dst`` (every array, in :func:`_output_fields` order)."""
    for name, key, dtype, shape in _output_fields(batch, routing_dims):
        value = out.values[name]
        value = np.asarray(value if key is None else value[key])
        if value.dtype != dtype or value.shape != shape:
            raise RuntimeError(f"{name}: {value.dtype}{value.shape}, expected {dtype}{shape}")
        dist.send(torch.from_numpy(np.ascontiguousarray(value)), dst=dst, group=group)


def recv_output(batch: ScoreBatch, routing_dims, group, src: int) -> ScoreOutput:
    """Receives the output of part ``batch`` from ``src`` (see :func:`send_output`)."""
    values = {out.name: {} for out in schema.OUTPUTS if out.keys is not None}
    for name, key, dtype, shape in _output_fields(batch, routing_dims):
        tensor = torch.from_numpy(np.empty(shape, dtype=dtype))
        dist.recv(tensor, src=src, group=group)
        if key is None:
            values[name] = tensor.numpy()
        else:
            values[name][key] = tensor.numpy()
    return ScoreOutput(values=values)


@dataclasses.dataclass(frozen=True)
class DataParallelGroup:
    """This rank's place among the DP ranks.

    Attributes:
        size: data-parallel ranks (1: no split).
        rank: this rank's DP rank.
        output_ranks: global output rank of every DP rank's TP x CP x PP group
            (index = DP rank; entry 0 is global rank 0).
        results: gloo group of ``output_ranks`` (None when ``size == 1``).
        peers: this rank's DP group (its peers at the same TP / CP / PP place; None when
            ``size == 1``): the prefix cache's blocks go to all of them.
    """

    size: int
    rank: int
    output_ranks: list[int]
    results: dist.ProcessGroup | None
    peers: dist.ProcessGroup | None = None

    @classmethod
    def create(cls, pg_collection, timeout_s: float) -> DataParallelGroup:
        """Every rank (collective: creates the results group when DP > 1).

        Megatron's rank order puts TP innermost, then CP, then DP, PP outermost: DP rank
        ``d``'s output rank is ``d x TP x CP`` (checked against the pipeline group).
        """
        dp, tp, cp = pg_collection.dp, pg_collection.tp, pg_collection.cp
        per_replica = tp.size() * cp.size()
        output_ranks = [d * per_replica for d in range(dp.size())]
        if tp.rank() == 0 and cp.rank() == 0:
            first = dist.get_global_rank(pg_collection.pp, 0)
            if first != output_ranks[dp.rank()]:
                raise RuntimeError(f"first stage of DP rank {dp.rank()} is {first}")
        results = None
        if dp.size() > 1:
            timeout = datetime.timedelta(seconds=timeout_s)
            results = dist.new_group(output_ranks, backend="gloo", timeout=timeout)
        return cls(dp.size(), dp.rank(), output_ranks, results, dp if dp.size() > 1 else None)

    def output_rank(self) -> int:
        """This rank's output rank (its DP rank's first stage, TP 0, CP 0)."""
        return self.output_ranks[self.rank]

    def run(
        self,
        model,
        batch: ScoreBatch,
        groups: StepGroups,
        cfg: StepConfig,
        routing_dims: tuple[int, int] | None = None,
    ) -> ScoreOutput | None:
        """Every rank: scores this DP rank's part of the step (module docstring).

        Args:
            model: this rank's model.
            batch: the whole step, identical on every rank.
            groups: the step's process groups.
            cfg: the step constants of this rank's TP x CP x PP group.
            routing_dims: ``(MoE layers, top-k)`` of a recorded routing (None: dense).

        Returns:
            The whole step's output on global rank 0, None elsewhere.

        Raises:
            StepFailedError: a rank failed the step (every rank).
            WorkerLostError: sending a part's output to rank 0 failed.
        """
        store = cfg.prefix_store if batch.cache_slots is not None else None
        if store is not None:
            store.written.clear()  # this step's writes only (a failed step's never shared)
            if batch.cache_moves is not None:
                store.move(batch.cache_moves)  # between the cache's tiers, before the forward
        if self.size == 1:
            result = run_step(model, batch, groups, cfg)
            return finish_step(batch, result) if dist.get_rank() == cfg.output_rank else None
        min_shared = shared_prefix(model, batch, cfg)
        shared = None
        if min_shared is not None:
            shared = shared_units(
                batch.token_ids,
                batch.lengths,
                pad_multiple=cfg.pad_multiple,
                min_shared=min_shared,
                token_keys=token_keys(batch),
                labels=batch.temperatures(),
                lead_rows=lead_rows(model, batch),
            )
        split = split_step(batch.lengths, self.size, cfg.pad_multiple, cfg.microbatches, shared)
        part_block = 0 if store is None else store.block
        part = sub_batch(batch, split.parts[self.rank], part_block)
        split_metrics = batch.return_moe_metrics and bool(model.config.num_moe_experts)
        cfg = dataclasses.replace(cfg, data_parallel_split=True)
        with aux_losses_over_data_parallel(model, split_metrics):
            result = run_step(model, part, groups, cfg, split.plans[self.rank])
        if store is not None:
            store.share_written(self.peers)
        if dist.get_rank() != cfg.output_rank:
            return None
        output = finish_step(part, result)
        try:
            if self.rank != 0:
                if part.num_sequences:
                    send_output(output, part, routing_dims, self.results, dst=0)
                return None
            parts = [(split.parts[0], output)]
            for d in range(1, self.size):
                if split.parts[d].size:
                    other = sub_batch(batch, split.parts[d], part_block)
                    src = self.output_ranks[d]
                    received = recv_output(other, routing_dims, self.results, src)
                    parts.append((split.parts[d], received))
        except RuntimeError as e:
            raise WorkerLostError(f"gathering the DP ranks' results failed: {e}") from e
        whole = selection.concat_outputs(parts, np.asarray(batch.lengths))
        whole.moe_metrics, whole.mtp_metrics = output.moe_metrics, output.mtp_metrics
        whole.metric_sums = output.metric_sums
        return whole

"""A step's forward through Megatron's own schedule, in microbatches.

Every layout runs the step through ``megatron.core.pipeline_parallel.
get_forward_backward_func()`` with ``forward_only=True``: the 1F1B schedule
without interleaving under pipeline parallelism (stages overlap on different
microbatches), the plain loop at PP = 1. The pieces follow NeMo-RL's logprob
path (``forward_step_arbitrary_loss`` / its loss post-processors):

* :func:`split_microbatches`: contiguous runs of sequences, balanced by padded
  tokens; every microbatch is packed (THD, the per-sequence pad multiple) and
  padded to one common length, so the stages exchange activations of a fixed
  shape. The padding is a segment of its own (``pack_sequences(pad_segment=True)``),
  not an extension of the last sequence: no real token attends to it, and a
  sequence's attention has the same shape in any microbatch (batch invariance).
  Megatron refuses ``variable_seq_lengths`` with the allgather MoE dispatcher, the
  one that runs on the CPU. A microbatch is
  never shorter than the step's longest sequence (that would pad every other
  microbatch up to it), so a step may use fewer microbatches than configured.
* :func:`forward_step`: called by the schedule with the data iterator and the
  model; runs the model on the next microbatch (around it, the MoE routers take the
  microbatch's routes to replay or give back the ones they chose,
  :mod:`megascore.engine.routing`) and returns the output with a loss closure. On
  the last stage the output is the model's
  :class:`~megascore.engine.forward.OutputHead`, and the closure computes the
  logprobs / top-k chunk by chunk over the TP group, gathers the CP shards and
  returns a loss normalised by the step's global valid token count
  (``cp_normalize`` under CP, then undoing Megatron's ``x cp / num_microbatches``
  scaling, as NeMo-RL does) with the per-token results.

The results stay on the last stage; :mod:`megascore.engine.step` moves them to
the output rank.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from megascore.api import layout, schema
from megascore.engine.distributed import gather_cp_shards
from megascore.engine.forward import forward_microbatch
from megascore.engine.logprobs import Float32Logits, score_tokens
from megascore.engine.packing import PackedSequences, roll_within_segments
from megascore.engine.prefix_tree import (
    SegmentLayout,
    concat_layouts,
    dense_layout,
    shared_groups,
    shared_layout,
)
from megascore.engine.routing import recorded_routes, set_replay_targets
from megascore.engine.segment_packing import pack_layout

logger = logging.getLogger(__name__)


def split_microbatches(
    lengths: np.ndarray, pad_multiple: int, count: int
) -> tuple[list[tuple[int, int]], int]:
    """Splits a step's sequences into contiguous, balanced microbatches.

    Args:
        lengths: int64 ``[B]`` sequence lengths (>= 1).
        pad_multiple: per-sequence pad multiple.
        count: microbatches wanted.

    Returns:
        ``(ranges, pad_to)``: ``[first, end)`` sequence ranges in batch order (at most
        ``count``, each non-empty) and the packed length every microbatch is padded to
        (the longest microbatch's; a multiple of ``pad_multiple``).
    """
    padded = layout.padded_lengths(np.asarray(lengths), pad_multiple)
    total, longest = int(padded.sum()), int(padded.max())
    count = max(1, min(count, len(padded), total // longest))
    cum = np.cumsum(padded)
    cuts = [0]
    for k in range(1, count):
        # the sequence boundary closest to k / count of the tokens, after the previous cut
        cut = int(np.argmin(np.abs(cum - k * total / count))) + 1
        cut = min(max(cut, cuts[-1] + 1), len(padded) - (count - k))
        cuts.append(cut)
    cuts.append(len(padded))
    ranges = list(zip(cuts[:-1], cuts[1:], strict=True))
    pad_to = max(int(padded[a:b].sum()) for a, b in ranges)
    return ranges, pad_to


@dataclasses.dataclass(frozen=True)
class MicrobatchPlan:
    """How one rank cuts its sequences of a step into microbatches.

    Attributes:
        ranges: ``[first, end)`` sequence ranges in batch order, one per microbatch. An
            empty one (``first == end``) is a microbatch of ``pad_to`` pad tokens: a
            data-parallel rank without sequences in it still joins its peers' expert
            collectives (:mod:`megascore.engine.data_parallel`).
        pad_to: packed length of every microbatch.
        segments: None: every sequence computed whole; else each range's microbatch as
            its groups sharing a prefix are computed (:func:`shared_units`, laid out by
            the split, ``sequences`` numbered like ``ranges``).
    """

    ranges: list[tuple[int, int]]
    pad_to: int
    segments: list[MicrobatchSegments] | None = None

    @classmethod
    def split(cls, lengths: np.ndarray, pad_multiple: int, count: int) -> MicrobatchPlan:
        """The dense plan of a rank that runs its step alone (:func:`split_microbatches`)."""
        ranges, pad_to = split_microbatches(lengths, pad_multiple, count)
        return cls(ranges=ranges, pad_to=pad_to)


@dataclasses.dataclass(frozen=True)
class MicrobatchSegments:
    """Which sequences of a step one microbatch holds, and how they are computed.

    Attributes:
        sequences: int64 ``[B_mb]`` the step's sequences in the microbatch's order.
        segments: their :class:`~megascore.engine.prefix_tree.SegmentLayout`.
    """

    sequences: np.ndarray
    segments: SegmentLayout


@dataclasses.dataclass(frozen=True)
class SharedUnits:
    """A step's sequences in groups that share a prefix: the units a step's microbatches
    (and data-parallel parts) are cut from, a group never cut apart.

    Attributes:
        groups: sequence indices per group (:func:`~megascore.engine.prefix_tree.shared_groups`).
        layouts: each group's :class:`~megascore.engine.prefix_tree.SegmentLayout`.
        costs: int64 ``[G]`` packed rows of each group's segments, padded.
    """

    groups: list[np.ndarray]
    layouts: list[SegmentLayout]
    costs: np.ndarray


def shared_units(
    token_ids: np.ndarray,
    lengths: np.ndarray,
    *,
    pad_multiple: int,
    min_shared: int,
    token_keys: np.ndarray | None = None,
    labels: np.ndarray | None = None,
) -> SharedUnits:
    """The groups of a step's sequences that share a prefix of ``>= min_shared`` tokens,
    with their layouts (arguments as :func:`plan_microbatches`)."""
    token_ids = np.asarray(token_ids, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    keys = token_ids[:, None] if token_keys is None else token_keys
    labels = np.zeros(len(lengths)) if labels is None else labels
    groups = shared_groups(keys, lengths, labels, min_shared)
    layouts = []
    for seqs in groups:
        tok = layout.token_index(lengths, seqs)
        layouts.append(
            shared_layout(
                token_ids[tok],
                lengths[seqs],
                min_shared=min_shared,
                token_keys=keys[tok],
                labels=labels[seqs],
            )
        )
    costs = np.array(
        [layout.padded_lengths(g.lengths, pad_multiple).sum() for g in layouts], dtype=np.int64
    ).reshape(-1)
    return SharedUnits(groups, layouts, costs)


def joined_groups(units: SharedUnits, lengths: np.ndarray, which) -> MicrobatchSegments:
    """One microbatch of the groups ``which`` (indices into ``units``), in that order."""
    groups = [units.groups[g] for g in which]
    if not groups:  # a data-parallel rank's microbatch of pad tokens only
        empty = np.zeros(0, dtype=np.int64)
        return MicrobatchSegments(empty, dense_layout(empty, empty))
    return MicrobatchSegments(
        np.concatenate(groups),
        concat_layouts([units.layouts[g] for g in which], [lengths[g] for g in groups]),
    )


def plan_microbatches(
    token_ids: np.ndarray,
    lengths: np.ndarray,
    *,
    pad_multiple: int,
    count: int,
    min_shared: int | None = None,
    token_keys: np.ndarray | None = None,
    labels: np.ndarray | None = None,
    cuts: MicrobatchPlan | None = None,
) -> tuple[list[MicrobatchSegments], int]:
    """Splits a step into microbatches, computing shared prefixes once when asked.

    Dense (``min_shared`` None): :func:`split_microbatches` of the sequences in batch
    order. Shared: the sequences that share a prefix (:func:`shared_units`) stay in one
    microbatch; groups are split like sequences, by what their segments occupy. Given
    ``cuts`` (a data-parallel rank's share), its ranges are the microbatches, dense or
    laid out shared by the split.

    Args:
        token_ids: int64 ``[T]`` the step's tokens.
        lengths: int64 ``[B]``.
        pad_multiple: per-segment pad multiple.
        count: microbatches wanted.
        min_shared: shortest prefix worth sharing, or None for the dense layout.
        token_keys: int64 ``[T, w]`` what must match for tokens to be shared (None: ids).
        labels: ``[B]`` sequences of different labels share nothing (None: all equal).
        cuts: the step's given microbatches (:mod:`megascore.engine.data_parallel`,
            whose ``segments`` replace ``min_shared``); None: cut here.

    Returns:
        ``(plans, pad_to)``: the microbatches in order and their common packed length.
    """
    token_ids = np.asarray(token_ids, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if cuts is None and min_shared is not None:
        units = shared_units(
            token_ids,
            lengths,
            pad_multiple=pad_multiple,
            min_shared=min_shared,
            token_keys=token_keys,
            labels=labels,
        )
        ranges, pad_to = split_microbatches(units.costs, pad_multiple, count)
        return [joined_groups(units, lengths, range(a, b)) for a, b in ranges], pad_to
    cuts = cuts or MicrobatchPlan.split(lengths, pad_multiple, count)
    if cuts.segments is not None:
        return list(cuts.segments), cuts.pad_to
    plans = []
    for a, b in cuts.ranges:
        seqs = np.arange(a, b, dtype=np.int64)
        tokens = token_ids[layout.token_index(lengths, seqs)]
        plans.append(MicrobatchSegments(seqs, dense_layout(tokens, lengths[seqs])))
    return plans, cuts.pad_to


@dataclasses.dataclass
class Microbatch:
    """One microbatch of a step, packed for this rank (built alike on every stage).

    Attributes:
        packed: the microbatch's segments (:class:`~megascore.engine.prefix_tree.SegmentLayout`:
            its sequences, or their shared prefixes and continuations), packed and
            padded to the step's common length.
        token_positions: int64 ``[T_mb]`` (CPU) packed row of every token of the
            microbatch's sequences (in the microbatch's sequence order); rows are
            shared by the tokens of a shared prefix.
        targets: int64 ``[T_local]`` next-token targets of this CP shard.
        temperature: float32 ``[T_local]`` or None.
        loss_mask: float32 ``[T_local]``: whether the target of each position is a
            scored token (the request's loss mask, Megatron's alignment; a shared row
            is scored where any of its sequences scores it).
        mtp_loss_mask: ``[1, T_local]`` the same mask for MTP when the request has one,
            else None (Megatron's default mask).
        replay_routes: int64 ``[n, L_stage, k]`` MoE routes this stage's routers replay
            (:func:`megascore.engine.routing.local_replay_targets`), or None.
        recorded_routes: set by the forward step when the step records the routing:
            int64 ``[n, L_stage, k]`` (None on a stage without MoE layers).
        target_ids: int64 ``[T_local, K]`` caller-chosen ids scored at each position
            (those given for the token the position predicts), or None.
        num_sequences: the microbatch's sequences.
        last_rows: int64 ``[n]`` (CPU) the local rows (this CP shard's) that hold the
            last token of a sequence: their output predicts the token after it
            (:func:`megascore.api.schema.at_last_row`). A sequence that ends where a shared
            prefix ends has its last token in the prefix's last row, which it shares.
        last_sequences: int64 ``[n]`` (CPU) which of the microbatch's sequences (its
            ``sequences`` order) each of ``last_rows`` ends.
    """

    packed: PackedSequences
    token_positions: torch.Tensor
    targets: torch.Tensor
    temperature: torch.Tensor | None
    loss_mask: torch.Tensor
    mtp_loss_mask: torch.Tensor | None
    replay_routes: torch.Tensor | None = None
    recorded_routes: torch.Tensor | None = None
    target_ids: torch.Tensor | None = None
    num_sequences: int = 0
    last_rows: torch.Tensor | None = None
    last_sequences: torch.Tensor | None = None


def build_microbatch(
    segments: SegmentLayout,
    temperature: np.ndarray | None,
    target_mask: np.ndarray,
    *,
    device: torch.device,
    pad_multiple: int,
    pad_to: int,
    cp_rank: int,
    cp_size: int,
    has_request_mask: bool,
    lengths: np.ndarray | None = None,
    target_ids: np.ndarray | None = None,
) -> Microbatch:
    """Packs one microbatch for this rank's CP rank.

    Args:
        segments: the microbatch's segments (its sequences in the dense layout).
        temperature: float32 ``[B_mb]`` or None.
        target_mask: float32 ``[T_mb]`` token-aligned: whether each token is scored.
        device: the model's device.
        pad_multiple: per-segment pad multiple.
        pad_to: common packed length of the step's microbatches.
        cp_rank: this rank in the CP group.
        cp_size: CP group size.
        has_request_mask: the request carried a loss mask (MTP then uses it).
        lengths: int64 ``[B_mb]`` the microbatch's sequence lengths (with ``target_ids``).
        target_ids: int64 ``[T_mb, K]`` token-aligned caller-chosen ids, or None.

    Returns:
        The :class:`Microbatch`. Without sequences (``lengths`` empty) it is the padding
        segment alone (``pad_to`` pad tokens).
    """
    packed = pack_layout(
        torch.from_numpy(segments.token_ids).to(device),
        segments,
        pad_multiple=pad_multiple,
        pad_to=pad_to,
        cp_rank=cp_rank,
        cp_size=cp_size,
        pad_segment=True,
    )
    cu_padded = packed.cu_seqlens_padded.to("cpu", torch.int64)
    shard = packed.shard_indices
    # targets: [1, T_padded] rolled on the full axis -> [T_local], sharded like the inputs
    targets = roll_within_segments(packed.input_ids, cu_padded)[0, shard.to(device)]
    temps = None
    if temperature is not None:
        per_segment = np.ones(len(cu_padded) - 1, dtype=np.float32)  # the padding segment: 1
        per_segment[: len(segments.lengths)] = np.asarray(temperature)[segments.sequences]
        temps = torch.repeat_interleave(torch.from_numpy(per_segment), cu_padded.diff())
        temps = temps[shard].to(device)
    # mask: token-aligned on the full axis (a row is scored where any of its tokens is),
    # then rolled to the targets' alignment
    row_mask = np.zeros(len(segments.token_ids), dtype=np.float32)
    if segments.shared:
        np.maximum.at(row_mask, segments.token_rows, target_mask)
    else:
        row_mask[segments.token_rows] = target_mask
    full = torch.zeros(1, pad_to)
    full[0, packed.token_positions] = torch.from_numpy(row_mask)
    mask = roll_within_segments(full, cu_padded, shifts=-1)[0, shard]
    positions = packed.token_positions[torch.from_numpy(segments.token_rows)]
    last_rows, last_sequences = _last_rows(positions, lengths, packed, pad_to)
    return Microbatch(
        packed=packed,
        token_positions=positions,
        targets=targets,
        temperature=temps,
        loss_mask=mask.to(device),
        mtp_loss_mask=mask.unsqueeze(0).to(device) if has_request_mask else None,
        target_ids=None
        if target_ids is None
        else _predicting_rows(target_ids, lengths, positions, packed, pad_to),
        num_sequences=0 if lengths is None else len(lengths),
        last_rows=last_rows,
        last_sequences=last_sequences,
    )


def _last_rows(
    positions: torch.Tensor, lengths: np.ndarray | None, packed: PackedSequences, pad_to: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local rows, sequences)`` of this CP shard's rows that hold a sequence's last token
    (``positions``: each token's packed row on the full axis), in sequence order."""
    if lengths is None or len(lengths) == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty
    last = positions[torch.from_numpy(layout.offsets(lengths)[1:] - 1)]  # [B_mb], full axis
    shard = packed.shard_indices.to("cpu", torch.int64)
    local = torch.full((pad_to,), -1, dtype=torch.int64)
    local[shard] = torch.arange(len(shard))
    rows = local[last]
    mine = (rows >= 0).nonzero().squeeze(1)
    return rows[mine], mine


def _predicting_rows(
    values: np.ndarray,
    lengths: np.ndarray,
    positions: torch.Tensor,
    packed: PackedSequences,
    pad_to: int,
) -> torch.Tensor:
    """Token-aligned ``[T_mb, K]`` rows moved to the packed position that predicts their
    token (one before it, ``positions``: each token's packed row; a sequence's first row
    has none and is dropped), this CP rank's shard of them, on the ids' device."""
    rows = torch.zeros((pad_to, values.shape[1]), dtype=torch.int64)
    predicted = torch.ones(positions.numel(), dtype=torch.bool)
    predicted[layout.offsets(lengths)[:-1]] = False  # each sequence's first token
    rows[positions[predicted] - 1] = torch.from_numpy(np.asarray(values, np.int64))[predicted]
    return rows[packed.shard_indices].to(packed.input_ids.device)


@dataclasses.dataclass(frozen=True)
class ScoreSpec:
    """What the last stage computes for every microbatch of a step.

    Attributes:
        outputs: the head outputs to compute (:func:`megascore.api.schema.head_outputs`).
        top_k: alternatives per position (0 = none).
        chunk_tokens: rows per chunk of the vocab-parallel log-softmax.
        vocab_size: true vocabulary size.
        global_valid_tokens: scored tokens of the whole step (loss normaliser, >= 1).
        num_microbatches: microbatches of the step.
        gather: this rank's CP group gathers the per-token results (the output side).
        metrics_forward: the forwards record MoE / MTP metrics
            (:func:`megascore.engine.forward.model_inputs`).
        lm_head_dtype: "model" (logits in the model dtype, as Megatron) or "float32".
        record_routes: keep each microbatch's MoE routes (``Microbatch.recorded_routes``).
        num_target_ids: K of the batch's target ids (0 without).
        scored_rows_only: compute the output head and log-softmax only at the rows that
            predict a scored token (``Microbatch.loss_mask``); the other rows get each
            output's fill. For steps that return no per-token output (no logprobs, no
            top-k), or that ask for them at the masked positions only
            (``logprob_positions`` "masked").
    """

    outputs: tuple[schema.Output, ...]
    top_k: int
    chunk_tokens: int
    vocab_size: int
    global_valid_tokens: int
    num_microbatches: int
    gather: bool
    metrics_forward: bool
    lm_head_dtype: str = "model"
    record_routes: bool = False
    num_target_ids: int = 0
    scored_rows_only: bool = False


def _score_microbatch(
    mb: Microbatch, spec: ScoreSpec, tp_group, cp_group, head
) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """The loss closure (last stage): per-token results, the results at each sequence's
    last row (:func:`_score_last_rows`) and the normalised loss."""
    cu_padded = mb.packed.cu_seqlens_padded.to("cpu", torch.int64)
    per_token = [out for out in spec.outputs if not schema.at_last_row(out)]
    targets, temperature, target_ids, rows = mb.targets, mb.temperature, mb.target_ids, None
    source = head
    if spec.scored_rows_only:  # the output head runs only where a scored token is predicted
        rows = mb.loss_mask.nonzero().squeeze(1)
        source = dataclasses.replace(head, hidden_states=head.hidden_states[rows])
        targets = targets[rows]
        temperature = None if temperature is None else temperature[rows]
        target_ids = None if target_ids is None else target_ids[rows]
    scores = score_tokens(
        source if spec.lm_head_dtype == "model" else Float32Logits(source),
        targets,
        tp_group=tp_group,
        temperature=temperature,
        top_k=spec.top_k,
        chunk_tokens=spec.chunk_tokens,
        vocab_size=spec.vocab_size,
        target_ids=target_ids,
        scratch=head.scratch,
        # the logprobs always: Megatron's schedule takes a loss from every microbatch
        outputs=list(dict.fromkeys([schema.output("logprobs"), *per_token])),
    )
    if rows is not None:  # [T_local, ...]: each output's fill where nothing was scored
        for name, value in list(scores.items()):
            if value is None:
                continue
            full = torch.full(
                (len(mb.loss_mask), *value.shape[1:]),
                schema.output(name).fill,
                dtype=value.dtype,
                device=value.device,
            )
            full[rows] = value
            scores[name] = full
    # loss: this CP shard's share of the step's token-mean NLL (NeMo-RL's normalisation
    # by the global valid token count); the CP ranks' shares sum to the microbatch's
    loss = -(scores.logprobs * mb.loss_mask).sum() / spec.global_valid_tokens
    cp_size = dist.get_world_size(cp_group)
    local_loss = loss.detach().clone()
    # cp_normalize, then undo Megatron's (x cp_size / num_microbatches) averaging
    loss = loss / cp_size * spec.num_microbatches / cp_size
    if cp_size > 1:
        dist.all_reduce(local_loss, group=cp_group)
    results = {"loss": local_loss.cpu()}
    for out in per_token:  # [T_local, ...] -> [T_padded, ...] on the CPU, same dtype
        if spec.gather:
            local = scores[out.name].unsqueeze(0)
            gathered = gather_cp_shards(local, cu_padded.to(local.device), cp_group)[0]
            results[out.name] = gathered.cpu()
    last = [out for out in spec.outputs if schema.at_last_row(out)]
    if last:
        results.update(_score_last_rows(mb, spec, last, tp_group, cp_group, head))
    return loss, results


def _score_last_rows(
    mb: Microbatch, spec: ScoreSpec, outputs: list[schema.Output], tp_group, cp_group, head
) -> dict[str, torch.Tensor]:
    """The outputs read at the last row of each sequence (the prediction after its last
    token, :func:`megascore.api.schema.at_last_row`): the head of those rows only, with a
    top-k of ``max(1, top_k)``, then one SUM over CP (each row lives on one CP rank).

    Returns:
        Output name -> ``[B_mb, *dims]`` on the CPU in the microbatch's sequence order
        (where this rank's CP group gathers the results; else empty).
    """
    rows = mb.last_rows.to(head.hidden_states.device)
    sub = dataclasses.replace(head, hidden_states=head.hidden_states[rows])
    scores = score_tokens(
        sub if spec.lm_head_dtype == "model" else Float32Logits(sub),
        None,
        tp_group=tp_group,
        temperature=None if mb.temperature is None else mb.temperature[rows],
        top_k=max(1, spec.top_k),
        chunk_tokens=spec.chunk_tokens,
        vocab_size=spec.vocab_size,
        scratch=head.scratch,
        outputs=outputs,
    )
    results = {}
    if not spec.gather:
        return results
    for out in outputs:
        value = scores[out.name]
        full = torch.zeros(
            (mb.num_sequences, *value.shape[1:]), dtype=value.dtype, device=value.device
        )
        full[mb.last_sequences.to(value.device)] = value
        if dist.get_world_size(cp_group) > 1:  # one rank holds each row, the others 0
            dist.all_reduce(full, group=cp_group)
        results[out.name] = full.cpu()
    return results


def forward_step(data_iterator, model, *, spec: ScoreSpec):
    """Megatron forward-step function (NeMo-RL's ``forward_step_arbitrary_loss`` shape).

    Args:
        data_iterator: yields this step's :class:`Microbatch` objects in order.
        model: this rank's GPTModel (one stage).
        spec: what the loss closure computes.

    Returns:
        ``(output, loss closure)``: the hidden states for the next stage, or on the
        last stage the :class:`~megascore.engine.forward.OutputHead` that the closure
        scores.
    """
    mb = next(data_iterator)
    if mb.replay_routes is not None:
        set_replay_targets(model, mb.replay_routes)
    output = forward_microbatch(
        model,
        mb.packed,
        metrics_forward=spec.metrics_forward,
        loss_mask_packed_local=mb.mtp_loss_mask,
    )
    if spec.record_routes:
        mb.recorded_routes = recorded_routes(model)
    pgs = model.pg_collection
    return output, functools.partial(_score_microbatch, mb, spec, pgs.tp, pgs.cp)


def run_schedule(model, microbatches: list[Microbatch], spec: ScoreSpec) -> list[dict]:
    """Runs the microbatches through Megatron's forward-only schedule on this rank.

    Collective over the replica (p2p between stages; TP / CP / EP inside each).

    Args:
        model: this rank's GPTModel, in the mode of the step
            (:func:`megascore.engine.forward.scoring_forward`).
        microbatches: the step's microbatches, in order.
        spec: what the last stage computes.

    Returns:
        On the last stage, one dict per microbatch (``loss`` and the gathered per-token
        results); an empty list on the other stages.
    """
    pp = model.pg_collection.pp
    seq_length = microbatches[0].packed.input_ids.shape[1]
    schedule = get_forward_backward_func(pp_size=pp.size(), vp_size=None)
    return schedule(
        forward_step_func=functools.partial(forward_step, spec=spec),
        data_iterator=iter(microbatches),
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=1,
        forward_only=True,
    )

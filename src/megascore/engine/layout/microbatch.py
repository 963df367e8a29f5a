"""One microbatch of a step, packed for this rank (built alike on every pipeline stage).

:func:`build_microbatch` packs the microbatch's segments
(:mod:`megascore.engine.layout.microbatch_plan`)
for this rank's CP rank (THD, the per-sequence pad multiple), padded to the step's common
length so that the stages exchange activations of a fixed shape. The padding is a segment of
its own (``pack_sequences(pad_segment=True)``), not an extension of the last sequence: no
real token attends to it, and a sequence's attention has the same shape in any microbatch
(batch invariance). Next-token targets are rolled inside each padded segment on the full
packed axis, then CP-sharded like the inputs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from megascore.api import layout
from megascore.engine.layout.packing import PackedSequences, roll_within_segments
from megascore.engine.layout.prefix_tree import SegmentLayout
from megascore.engine.layout.segment_packing import pack_layout


@dataclasses.dataclass
class Microbatch:
    """One microbatch of a step, packed for this rank (built alike on every stage).

    Attributes:
        packed: the microbatch's segments
            (:class:`~megascore.engine.layout.prefix_tree.SegmentLayout`:
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
            else None (Megatron's default mask). Where rows are shared (prefixes,
            identical sequences) it counts, at each row, the sequences whose scored
            next token that row predicts (an MTP metric weighs a shared row by the
            sequences it stands for).
        replay_routes: int64 ``[n, L_stage, k]`` MoE routes this stage's routers replay
            (:func:`megascore.engine.outputs.routing.local_replay_targets`), or None.
        recorded_routes: set by the forward step when the step records the routing:
            int64 ``[n, L_stage, k]`` (None on a stage without MoE layers).
        head_inputs: each head input of the table (:func:`megascore.api.schema.head_inputs`)
            at this shard's positions, ``[T_local, ...]``: at each position the values
            given for the token it predicts.
        num_sequences: the microbatch's sequences.
        lengths: int64 ``[num_sequences]`` (CPU) their lengths, or None.
        last_rows: int64 ``[n]`` (CPU) the local rows (this CP shard's) that hold the
            last token of a sequence: their output predicts the token after it
            (:func:`megascore.api.schema.at_last_row`). A sequence that ends where a shared
            prefix ends has its last token in the prefix's last row, which it shares.
        last_sequences: int64 ``[n]`` (CPU) which of the microbatch's sequences (its
            ``sequences`` order) each of ``last_rows`` ends.
        adapter_rows: int64 ``[T_local]`` (CPU) the LoRA adapter slot of every row the
            model sees on this rank, -1 the base
            (:func:`megascore.engine.schedule.adapter_rows.set_adapter_rows`), or None.
    """

    packed: PackedSequences
    token_positions: torch.Tensor
    targets: torch.Tensor
    temperature: torch.Tensor | None
    loss_mask: torch.Tensor
    mtp_loss_mask: torch.Tensor | None
    replay_routes: torch.Tensor | None = None
    recorded_routes: torch.Tensor | None = None
    head_inputs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    num_sequences: int = 0
    lengths: torch.Tensor | None = None
    last_rows: torch.Tensor | None = None
    last_sequences: torch.Tensor | None = None
    adapter_rows: torch.Tensor | None = None


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
    head_inputs: dict[str, np.ndarray] | None = None,
    cache=None,
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
        lengths: int64 ``[B_mb]`` the microbatch's sequence lengths (with ``head_inputs``
            or shared segments).
        head_inputs: token-aligned ``[T_mb, ...]`` head inputs by name (none: None).
        cache: the microbatch's cached rows and cache view
            (:func:`megascore.engine.cache.store.microbatch_cache`), or None.

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
        cache=cache,
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
    rows_shared = segments.rows_shared
    if rows_shared:
        np.maximum.at(row_mask, segments.token_rows, target_mask)
    else:
        row_mask[segments.token_rows] = target_mask
    full = torch.zeros(1, pad_to)
    full[0, packed.token_positions] = torch.from_numpy(row_mask)
    mask = roll_within_segments(full, cu_padded, shifts=-1)[0, shard]
    positions = packed.token_positions[torch.from_numpy(segments.token_rows)]
    last_rows, last_sequences = _last_rows(positions, lengths, packed, pad_to)
    mtp_mask = mask.unsqueeze(0) if has_request_mask else None
    if rows_shared:
        mtp_mask = _prediction_counts(target_mask, lengths, positions, pad_to)[shard][None]
    return Microbatch(
        packed=packed,
        token_positions=positions,
        targets=targets,
        temperature=temps,
        loss_mask=mask.to(device),
        mtp_loss_mask=None if mtp_mask is None else mtp_mask.to(device),
        head_inputs={
            name: _predicting_rows(values, lengths, positions, packed, pad_to)
            for name, values in (head_inputs or {}).items()
        },
        num_sequences=0 if lengths is None else len(lengths),
        lengths=None if lengths is None else torch.as_tensor(lengths, dtype=torch.int64),
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


def _predicted(lengths: np.ndarray, count: int) -> torch.Tensor:
    """bool ``[count]``: the tokens that have a predicting row (all but each sequence's first)."""
    predicted = torch.ones(count, dtype=torch.bool)
    predicted[layout.offsets(lengths)[:-1]] = False
    return predicted


def _prediction_counts(
    target_mask: np.ndarray, lengths: np.ndarray, positions: torch.Tensor, pad_to: int
) -> torch.Tensor:
    """float32 ``[pad_to]``: per packed row (full axis), the scored tokens it predicts
    (``target_mask``, token-aligned; a token's predicting row is the one before its own,
    ``positions``), summed over the sequences that share the row."""
    predicted = _predicted(lengths, positions.numel())
    counts = torch.zeros(pad_to)
    counts.index_add_(0, positions[predicted] - 1, torch.from_numpy(target_mask)[predicted])
    return counts


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
    predicted = _predicted(lengths, positions.numel())
    rows[positions[predicted] - 1] = torch.from_numpy(np.asarray(values, np.int64))[predicted]
    return rows[packed.shard_indices].to(packed.input_ids.device)

"""Sequence packing into Megatron's THD layout and context-parallel sharding.

The layout is the one NeMo-RL's ``_pack_sequences_for_megatron`` produces, so a
model trained with NeMo-RL packing sees identical inputs here:

* sequence ``b`` occupies ``[cu_seqlens_padded[b], cu_seqlens_padded[b+1])`` of
  the packed axis: its ``seq_lengths[b]`` real tokens first, then pad token 0 up
  to ``round_up_to_multiple(seq_lengths[b], pad_individual_seqs_to_multiple_of)``;
* ``pad_packed_seq_to`` raises the *last* boundary: the extra pad tokens belong
  to the last sequence's padded segment (NeMo-RL), or, with ``pad_segment=True``
  (megascore's microbatches), form a segment of their own after it: an empty
  sequence whose padded segment holds them, so no real token attends to them and the
  last sequence's attention has the shape it has alone;
* ``PackedSeqParams(qkv_format="thd")`` carries the padded boundaries for q and
  kv (also as ``cu_seqlens_*_padded``) and the longest padded segment as
  ``max_seqlen_*``;
* with context parallelism every padded segment is cut into ``2 * cp_size``
  equal chunks and rank ``r`` keeps chunks ``r`` and ``2 * cp_size - 1 - r``
  (load-balanced causal attention), segment after segment.

Unlike NeMo-RL, nothing is truncated silently: pad and CP settings that do not
fit the layout raise ``ValueError`` naming the offending sequence. A zero-length
sequence among non-empty ones is allowed and occupies 0 packed tokens (its
padded length is ``round_up_to_multiple(0, m) == 0``), giving an empty segment
with two equal boundaries.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megascore.api import layout

logger = logging.getLogger(__name__)

PAD_TOKEN_ID = 0


class PackedSequences(NamedTuple):
    """Result of :func:`pack_sequences`.

    Attributes:
        input_ids: ``[1, T]`` the full packed ids (``T = cu_seqlens_padded[-1]``).
        input_ids_cp_sharded: ``[1, T / cp_size]`` this CP rank's shard (the model input).
        packed_seq_params: THD parameters with the padded boundaries.
        cu_seqlens: int32 ``[B+1]`` boundaries of the real tokens.
        cu_seqlens_padded: int32 ``[B+1]`` boundaries of the padded segments.
        token_positions: int64 ``[T]`` (CPU) packed position of every real token, in
            the order of the flat input: the packed <-> flat index.
        shard_indices: int64 ``[T / cp_size]`` (CPU) :func:`cp_shard_indices` of this
            CP rank: ``full[:, shard_indices]`` is this rank's shard of any full
            packed tensor.
    """

    input_ids: torch.Tensor
    input_ids_cp_sharded: torch.Tensor
    packed_seq_params: PackedSeqParams
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    token_positions: torch.Tensor
    shard_indices: torch.Tensor


def round_up_to_multiple(value: int, multiple: int) -> int:
    """Rounds ``value`` up to the next multiple of ``multiple``.

    Args:
        value: a non-negative integer.
        multiple: a positive integer.

    Returns:
        The smallest multiple of ``multiple`` that is >= ``value``.
    """
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    return -(-value // multiple) * multiple


def _segment_lengths(cu_seqlens_padded: torch.Tensor) -> list[int]:
    bounds = [int(x) for x in cu_seqlens_padded.tolist()]
    if len(bounds) < 2 or bounds[0] != 0:
        raise ValueError(f"cu_seqlens_padded must start at 0 and have >= 2 entries: {bounds}")
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    for b, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"cu_seqlens_padded decreases at sequence {b}: {bounds}")
    return lengths


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """int64 CPU :func:`megascore.api.layout.ranges` of CPU tensors."""
    return torch.from_numpy(layout.ranges(starts.numpy(), lengths.numpy()))


def cp_shard_indices(cu_seqlens_padded: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Indices into the full packed axis that form one context-parallel rank's shard.

    ``full[:, cp_shard_indices(...)]`` is exactly what :func:`pack_sequences` puts
    in ``input_ids_cp_sharded``; use it to shard targets and masks identically.

    Args:
        cu_seqlens_padded: ``[B+1]`` padded segment boundaries.
        cp_rank: this rank's index in the CP group, ``0 <= cp_rank < cp_size``.
        cp_size: size of the CP group.

    Returns:
        int64 ``[T / cp_size]`` indices (on the CPU), segment after segment: chunk
        ``cp_rank`` then chunk ``2 * cp_size - 1 - cp_rank`` of each segment.

    Raises:
        ValueError: bad rank/size, or a segment length not divisible by ``2 * cp_size``.
    """
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    seg_lens = _segment_lengths(cu_seqlens_padded)
    total = int(cu_seqlens_padded[-1])
    if cp_size == 1:
        return torch.arange(total, dtype=torch.long)
    n_chunks = 2 * cp_size
    for b, length in enumerate(seg_lens):
        if length % n_chunks:
            raise ValueError(
                f"sequence {b}: padded length {length} is not divisible by 2 * cp_size = "
                f"{n_chunks}; pad sequences to a multiple of {n_chunks}"
            )
    starts = cu_seqlens_padded[:-1].to(device="cpu", dtype=torch.long)
    chunk = torch.tensor(seg_lens, dtype=torch.long) // n_chunks
    # run_starts: [B, 2] -> [2B], first and mirrored chunk of each segment
    run_starts = torch.stack(
        [starts + cp_rank * chunk, starts + (n_chunks - 1 - cp_rank) * chunk], dim=1
    ).reshape(-1)
    run_lens = chunk.repeat_interleave(2)
    return _ranges(run_starts, run_lens)


def _check_cp_layout(multiple: int, cp_rank: int, cp_size: int) -> None:
    """The pad multiple and CP rank / size fit the layout (``ValueError`` otherwise)."""
    if multiple < 1:
        raise ValueError(f"pad_individual_seqs_to_multiple_of must be >= 1, got {multiple}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    if cp_size > 1 and multiple % (2 * cp_size):
        raise ValueError(
            f"pad_individual_seqs_to_multiple_of ({multiple}) must be a multiple of "
            f"2 * cp_size = {2 * cp_size} with context parallelism"
        )


def _padded_segments(
    lengths: list[int],
    multiple: int,
    pad_packed_seq_to: int | None,
    cp_size: int,
    pad_segment: bool,
) -> list[int]:
    """Each sequence's padded segment; the padding up to ``pad_packed_seq_to`` goes to
    the last one, or with ``pad_segment`` to a segment of its own appended after it
    (``ValueError`` when it does not fit)."""
    padded = [round_up_to_multiple(length, multiple) for length in lengths]
    natural_total = sum(padded)
    if pad_packed_seq_to is not None:
        if pad_packed_seq_to < natural_total:
            raise ValueError(
                f"pad_packed_seq_to ({pad_packed_seq_to}) is smaller than the packed length "
                f"{natural_total} of {len(lengths)} sequences"
            )
        if cp_size > 1 and pad_packed_seq_to % (2 * cp_size):
            raise ValueError(
                f"sequence {len(lengths) - 1}: pad_packed_seq_to ({pad_packed_seq_to}) must "
                f"be a multiple of 2 * cp_size = {2 * cp_size}"
            )
        tail = pad_packed_seq_to - natural_total
        if pad_segment and tail:
            padded.append(tail)
        else:
            padded[-1] += tail
    return padded


def _thd_params(cu_seqlens_padded: torch.Tensor, max_seqlen: int, total_tokens: int | None):
    """Megatron's THD ``PackedSeqParams`` over the padded segments."""
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens_padded,
        cu_seqlens_kv=cu_seqlens_padded,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        # Only Mamba's seq_idx reads this. NeMo-RL passes the CP-local token count,
        # which with CP builds a seq_idx that matches neither the full layout nor
        # the shard; we set it only where the boundaries describe the model input.
        total_tokens=total_tokens,
    )


def pack_sequences(
    token_ids: torch.Tensor,
    seq_lengths: torch.Tensor | Sequence[int],
    *,
    pad_individual_seqs_to_multiple_of: int = 1,
    pad_packed_seq_to: int | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    pad_segment: bool = False,
) -> PackedSequences:
    """Packs flat sequences into one THD sequence (NeMo-RL layout).

    Args:
        token_ids: ``[T]`` ids, all sequences concatenated (``T = sum(seq_lengths)``).
        seq_lengths: ``[B]`` tokens per sequence (0 allowed, not all 0; the engine's
            batches come checked by :meth:`megascore.api.types.ScoreBatch.check`).
        pad_individual_seqs_to_multiple_of: every sequence is padded to a multiple of
            this; with ``cp_size > 1`` it must be a multiple of ``2 * cp_size``.
        pad_packed_seq_to: total packed length (before CP sharding); the padding
            is appended to the last sequence's segment. Must be >= the packed length
            and, with CP, a multiple of ``2 * cp_size``.
        cp_rank: this rank's index in the CP group.
        cp_size: size of the CP group.
        pad_segment: the padding up to ``pad_packed_seq_to`` is a segment of its own
            (an extra empty sequence at the end: ``cu_seqlens`` and
            ``cu_seqlens_padded`` get one more boundary) instead of the last
            sequence's.

    Returns:
        A :class:`PackedSequences`; ids and boundaries on ``token_ids.device``, the
        index tensors and the ``packed_seq_params`` boundaries on the CPU
        (:func:`megascore.engine.schedule.packed_inputs.model_inputs` moves them where the
        attention backend needs them).

    Raises:
        ValueError: where the inputs do not fit the layout (names the sequence).
    """
    if token_ids.dim() != 1:
        raise ValueError(f"token_ids must be [T], got shape {tuple(token_ids.shape)}")
    lengths = [
        int(x) for x in (seq_lengths.tolist() if torch.is_tensor(seq_lengths) else seq_lengths)
    ]
    multiple = pad_individual_seqs_to_multiple_of
    _check_cp_layout(multiple, cp_rank, cp_size)
    # 1. segment lengths: each sequence padded, then the padding up to pad_packed_seq_to
    padded = _padded_segments(lengths, multiple, pad_packed_seq_to, cp_size, pad_segment)
    if len(padded) > len(lengths):  # the padding's own segment: an empty sequence
        lengths.append(0)
    device = token_ids.device
    starts = layout.offsets(padded)  # [B+1]: where each padded segment starts, then T_padded
    cu_seqlens = torch.from_numpy(layout.offsets(lengths).astype(np.int32)).to(device)
    cu_seqlens_padded = torch.from_numpy(starts.astype(np.int32))
    total = int(starts[-1])
    # 2. scatter the real tokens to their packed positions; the rest stays pad
    positions = torch.from_numpy(layout.ranges(starts[:-1], lengths))  # [T]
    packed = torch.full((total,), PAD_TOKEN_ID, dtype=token_ids.dtype, device=device)
    packed[positions.to(device)] = token_ids
    packed = packed.unsqueeze(0)  # [1, T_padded]
    # 3. this CP rank's shard, and Megatron's THD boundaries
    shard = cp_shard_indices(cu_seqlens_padded, cp_rank, cp_size)  # [T_padded / cp]
    # the params keep host boundaries: what reads them per layer reads no device value
    params = _thd_params(cu_seqlens_padded, max(padded), total if cp_size == 1 else None)
    cu_seqlens_padded = cu_seqlens_padded.to(device)
    return PackedSequences(
        input_ids=packed.contiguous(),
        input_ids_cp_sharded=packed[:, shard.to(device)].contiguous() if cp_size > 1 else packed,
        packed_seq_params=params,
        cu_seqlens=cu_seqlens,
        cu_seqlens_padded=cu_seqlens_padded,
        token_positions=positions,
        shard_indices=shard,
    )


def roll_within_segments(
    packed: torch.Tensor, cu_seqlens_padded: torch.Tensor, shifts: int = -1
) -> torch.Tensor:
    """Rolls every padded segment of the packed axis independently (like ``torch.roll``).

    With ``shifts=-1`` position ``t`` of a segment receives position ``t + 1`` and
    the last position receives the segment's first: next-token targets. Build
    targets this way on the full packed tensor, then CP-shard them.

    Args:
        packed: ``[1, T, ...]`` full (not CP-sharded) packed tensor.
        cu_seqlens_padded: ``[B+1]`` padded boundaries, last one ``== T``.
        shifts: roll distance, as in ``torch.roll``.

    Returns:
        ``[1, T, ...]`` rolled copy.
    """
    seg_lens = _segment_lengths(cu_seqlens_padded)
    if packed.dim() < 2 or packed.shape[0] != 1 or packed.shape[1] != int(cu_seqlens_padded[-1]):
        raise ValueError(
            f"packed must be [1, {int(cu_seqlens_padded[-1])}, ...], got {tuple(packed.shape)}"
        )
    lens = torch.tensor(seg_lens, dtype=torch.long)
    starts = cu_seqlens_padded[:-1].to(device="cpu", dtype=torch.long)
    pos = _ranges(starts, lens)  # [T] = arange(T)
    seg_start = torch.repeat_interleave(starts, lens)
    seg_len = torch.repeat_interleave(lens, lens)
    src = seg_start + torch.remainder(pos - seg_start - shifts, seg_len)
    return packed[:, src.to(packed.device)]

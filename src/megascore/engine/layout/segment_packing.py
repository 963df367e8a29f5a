"""Packing of a :class:`~megascore.engine.layout.prefix_tree.SegmentLayout`: segments
continuing a prefix.

The segments are packed like sequences (:func:`megascore.engine.layout.packing.pack_sequences`:
THD, every segment padded on its own). A layout with shared prefixes gets a
:class:`SharedPrefixParams` instead of the plain ``PackedSeqParams``: the same
boundaries plus each segment's parent, real length and first position. Three
places read it:

* the core attention (:class:`megascore.model.attention.TorchCoreAttention`) lets a
  segment's rows attend to :func:`prefix_rows` first, then causally to its own;
* :func:`full_positions` continues positions from the prefix (the model's
  ``position_ids``: learned position embeddings);
* :func:`rope_positions` makes the model's RoPE tables follow the same positions,
  through Megatron's packed-frequency path (``freqs`` with one row per packed
  position, ``_apply_rotary_pos_emb_thd``): GPTModel's table, or the one each
  multi-latent attention module applies to its queries and keys itself; dense
  packings take the same path (one rotation over the batch instead of one per
  sequence).

Under context parallelism the segments are sharded like sequences (2 x CP chunks
each, load-balanced); the attention all-gathers K and V, so a continuation's rows reach
its prefix's rows on every CP rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

from megascore.config import EngineConfig
from megascore.engine.layout.packing import PackedSequences, pack_sequences
from megascore.engine.layout.prefix_tree import SegmentLayout

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SharedPrefixParams(PackedSeqParams):
    """``PackedSeqParams`` of segments that continue other segments (see the module docstring).

    Attributes:
        segment_parents: parent of each segment (-1: a root), parents first.
        segment_lengths: real tokens of each segment (its padded length is in the bounds).
        segment_offsets: position of each segment's first row in its sequences.
        cached_rows: per root segment with an offset, the rows of its cached prefix on
            the attention's key axis (after the packed rows: ``megascore.engine.cache``);
            empty where none.
        prefix_cache: the step's :class:`megascore.engine.cache.store.CacheView` (what
            every attention layer writes to and reads from the cache), or None.
    """

    segment_parents: tuple[int, ...] = ()
    segment_lengths: tuple[int, ...] = ()
    segment_offsets: tuple[int, ...] = ()
    cached_rows: tuple[torch.Tensor, ...] = ()
    prefix_cache: object | None = None


def prefix_rows(params: SharedPrefixParams) -> list[torch.Tensor]:
    """Packed rows every segment attends to before its own, in position order.

    A child sees the rows of the positions before its first one: its parent's prefix
    rows, then the parent's own rows (its lead rows repeat the parent's last ones), so
    segment ``s`` gets ``segment_offsets[s]`` rows. A root with an offset sees its cached
    rows (``cached_rows``).

    Returns:
        int64 CPU tensors, one per segment (empty for a root).
    """
    starts = params.cu_seqlens_q_padded.tolist()
    offsets = params.segment_offsets
    rows: list[torch.Tensor] = []
    for s, parent in enumerate(params.segment_parents):
        if parent < 0:
            cached = params.cached_rows[s] if s < len(params.cached_rows) else None
            rows.append(torch.empty(0, dtype=torch.long) if cached is None else cached)
            if len(rows[s]) != offsets[s]:
                raise ValueError(f"segment {s}: {len(rows[s])} cached rows, offset {offsets[s]}")
            continue
        own = torch.arange(params.segment_lengths[parent]) + starts[parent]
        rows.append(torch.cat([rows[parent], own])[: offsets[s]])
        if len(rows[s]) != offsets[s]:
            raise ValueError(f"segment {s}: {len(rows[s])} prefix rows, offset {offsets[s]}")
    return rows


def pack_layout(
    token_ids: torch.Tensor,
    segments: SegmentLayout,
    *,
    pad_multiple: int,
    pad_to: int,
    cp_rank: int,
    cp_size: int,
    pad_segment: bool = False,
    cache=None,
) -> PackedSequences:
    """Packs a microbatch's segments.

    Args:
        token_ids: int64 ``[N]`` the segments' tokens (``segments.token_ids``), on the
            model's device.
        segments: the layout.
        pad_multiple: per-segment pad multiple.
        pad_to: packed length.
        cp_rank: this rank in the CP group.
        cp_size: CP group size.
        pad_segment: the padding up to ``pad_to`` is a segment of its own
            (:func:`~megascore.engine.layout.packing.pack_sequences`); it continues nothing.
        cache: ``(cached_rows, view)`` of a step that reads or writes the prefix cache
            (:func:`megascore.engine.cache.store.microbatch_cache`), or None.

    Returns:
        The :class:`~megascore.engine.layout.packing.PackedSequences` of the segments: its
        ``token_positions`` are the packed rows of the segments' tokens (``[N]``).
    """
    packed = pack_sequences(
        token_ids,
        segments.lengths,
        pad_individual_seqs_to_multiple_of=pad_multiple,
        pad_packed_seq_to=pad_to,
        cp_rank=cp_rank,
        cp_size=cp_size,
        pad_segment=pad_segment,
    )
    if not segments.shared and cache is None:
        return packed
    p = packed.packed_seq_params
    padded = p.cu_seqlens_q_padded.diff().tolist()  # host boundaries
    extra = len(padded) - len(segments.lengths)  # the padding's own segment: a root
    parents = [int(x) for x in segments.parents] + [-1] * extra
    offsets = [int(x) for x in segments.offsets] + [0] * extra
    longest = max(o + n for o, n in zip(offsets, padded, strict=True))
    params = SharedPrefixParams(
        **{f.name: getattr(p, f.name) for f in dataclasses.fields(PackedSeqParams)},
        segment_parents=tuple(parents),
        segment_lengths=tuple(int(x) for x in segments.lengths) + (0,) * extra,
        segment_offsets=tuple(offsets),
        cached_rows=() if cache is None else tuple(cache[0]),
        prefix_cache=None if cache is None else cache[1],
    )
    params.max_seqlen_q = params.max_seqlen_kv = longest  # RoPE table length
    return packed._replace(packed_seq_params=params)


def full_positions(cu_seqlens_padded: torch.Tensor, params: PackedSeqParams) -> torch.Tensor:
    """int64 ``[T]`` position of every packed row in its sequence (full packed axis)."""
    cu = cu_seqlens_padded.to("cpu", torch.long)
    lens = cu.diff()
    pos = torch.arange(int(cu[-1])) - torch.repeat_interleave(cu[:-1], lens)
    if isinstance(params, SharedPrefixParams):
        pos += torch.repeat_interleave(torch.tensor(params.segment_offsets, dtype=torch.long), lens)
    return pos


@contextlib.contextmanager
def rope_positions(model, packed: PackedSequences):
    """Inside the block the model's RoPE tables have one row per packed position, at that
    row's position in its sequence (:func:`full_positions`).

    Megatron then rotates the whole packed batch in one pass (its packed-frequency THD
    path, also under CP: it picks this rank's rows of each sequence by the sequence's
    packed offset) instead of one pass per sequence, and a shared prefix's continuation
    is rotated at the positions that follow the prefix. The tables are those of
    :func:`_rope_tables`: GPTModel's, or each multi-latent attention's own. A no-op
    without such a table (other position embeddings, the fused RoPE kernel) and for
    non-THD input.
    """
    params = packed.packed_seq_params
    tables = _rope_tables(model) if params.qkv_format == "thd" else []
    if not tables:
        yield
        return
    rows = full_positions(params.cu_seqlens_q_padded, params).to(packed.input_ids.device)

    def per_row(module, args, output):
        # RotaryEmbedding: [max_seqlen, 1, 1, dim]; YarnRotaryEmbedding: (that, mscale)
        if isinstance(output, tuple):
            return output[0][rows], *output[1:]  # [T, 1, 1, dim], mscale
        return output[rows]  # [T, 1, 1, dim]

    handles = [table.register_forward_hook(per_row) for table in tables]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _rope_tables(model) -> list[torch.nn.Module]:
    """The rotary embeddings :func:`rope_positions` re-indexes.

    GPTModel's table (RoPE position embeddings), or, for multi-latent attention, the one
    every MLA module (decoder and MTP layers) builds and applies itself. MLA asks its
    table for ``max_seqlen`` rows with ``packed_seq=True`` (not CP-sliced) and, under CP,
    keeps it whole, so its rows index the full packed axis as GPTModel's do. None with
    the fused RoPE kernel: its THD kernel indexes the table by position inside the
    sequence (and YaRN's fused path fills a cos / sin cache from the table).
    """
    if model.config.apply_rope_fusion:
        return []
    if model.config.multi_latent_attention:
        return [m.rotary_pos_emb for m in model.modules() if isinstance(m, MultiLatentAttention)]
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None or model.position_embedding_type != "rope":
        return []
    return [rotary]


def _unsupported(model) -> str | None:
    """Why a built model cannot compute shared prefixes, or None."""
    if model.position_embedding_type not in ("rope", "learned_absolute", "none"):
        return f"{model.position_embedding_type!r} position embeddings"
    if getattr(model, "megascore_attention_backend", "torch") != "torch":
        return "the TransformerEngine attention backend"
    rope = model.position_embedding_type == "rope" or model.config.multi_latent_attention
    if rope and model.config.apply_rope_fusion:
        return "the fused RoPE kernel"
    return None


def min_shared_prefix(engine_cfg: EngineConfig, device: torch.device, model) -> int | None:
    """The shortest prefix a replica's steps share, or None when its steps run dense.

    ``prefix_sharing`` None (auto) is on for the CPU and off on CUDA (its kernels'
    speed is not measured yet: docs/deploy.md), True on, False off. A model or layout
    that cannot share (:func:`_unsupported`) runs dense, with a warning when sharing was
    asked for explicitly.

    Args:
        engine_cfg: the engine config.
        device: the model's device.
        model: this rank's built GPTModel.

    Returns:
        ``engine_cfg.min_shared_prefix`` or None.
    """
    auto_off = engine_cfg.prefix_sharing is None and device.type == "cuda"
    if engine_cfg.prefix_sharing is False or auto_off:
        return None
    reason = _unsupported(model)
    if reason is not None:
        log = logger.warning if engine_cfg.prefix_sharing else logger.info
        log("prefix sharing off: %s", reason)
        return None
    return engine_cfg.min_shared_prefix

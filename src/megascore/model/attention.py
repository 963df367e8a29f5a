"""Portable core attention (the "torch" backend): PyTorch SDPA per packed sequence.

:class:`TorchCoreAttention` replaces Megatron's local ``DotProductAttention`` in
the layer ``ModuleSpec`` (see ``megascore.model.build``). It takes the same
constructor and forward arguments and supports what the local module does not:

* packed THD input (``packed_seq_params.qkv_format == "thd"``): every padded
  segment ``[cu_seqlens_q_padded[i], cu_seqlens_q_padded[i+1])`` is attended
  causally on its own. Segments of equal length are batched into one SDPA call,
  so memory is linear in the number of tokens plus one ``L x L`` score block per
  segment length (never a ``T x T`` mask over the pack);
* plain causal ``[s, b, heads, dim]`` input (``packed_seq_params`` None);
* GQA (``num_query_groups < num_attention_heads``) through SDPA's ``enable_gqa`` (on
  CUDA a masked or float32 call expands the K/V heads instead, so that the
  memory-efficient kernel takes it: :mod:`megascore.model.sdpa`);
* context parallelism: K and V are all-gathered in the CP group and every local
  query chunk attends to the keys that precede it. The layout is Megatron's
  load-balanced one: each (padded) sequence is cut into ``2 * cp`` chunks and CP
  rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` in that order;
* shared prefixes (:class:`megascore.engine.layout.segment_packing.SharedPrefixParams`, any CP size:
  the prefix rows are looked up in the gathered keys): a segment that continues a
  prefix attends causally to its own rows like any segment (batched with the other
  continuations of its length), and the rows of all the continuations of one parent
  attend to their common prefix rows (:func:`megascore.engine.layout.segment_packing.prefix_rows`)
  in one more call without a mask (every prefix row precedes them); the two partial
  softmaxes are merged by their log-sum-exps into the one softmax over prefix and own
  keys. Both calls go through :func:`megascore.model.sdpa.attention_with_lse`, on the CPU
  and on CUDA alike; segments without a prefix keep the plain SDPA call
  (:func:`megascore.model.sdpa.chunk_attention`).

* the key-block attention (``key_block`` > 0, with the prefix cache:
  :mod:`megascore.model.key_blocks`, CP 1): query blocks aligned at the start of their
  sequences, each attending causally to its own rows and then to every key before it (a
  cached prefix, a shared parent, its own earlier rows), so that a row's numbers do not
  depend on how its sequence was split; the cached rows follow the packed rows on the
  key axis (``SharedPrefixParams.prefix_cache``).

A call reads rows that follow each other (one segment at CP 1, a parent's children side
by side, its prefix) as a view of the packed tensor and writes its output in place; other
rows are gathered and scattered by index (measured on ``tiny``: the gathers were ~13 % of
the attention's time in an RL step, dense and shared alike).

Numbers equal a dense causal softmax attention per sequence within fp32 rounding.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megascore.engine.layout.packing import cp_shard_indices
from megascore.engine.layout.segment_packing import SharedPrefixParams, prefix_rows
from megascore.model import key_blocks
from megascore.model.key_blocks import KeySegment
from megascore.model.sdpa import attention_with_lse, chunk_attention, merge

logger = logging.getLogger(__name__)

_PLAN_ATTR = "_megascore_attention_plan"


@dataclasses.dataclass(frozen=True)
class _Bucket:
    """One batched SDPA call: ``n`` query chunks of ``q_len`` tokens, ``k_len`` keys each.

    Attributes:
        q_index: ``[n, q_len]`` positions of the queries (and outputs) in the local tensor.
        k_index: ``[n, k_len]`` positions of the keys in the (gathered) key tensor.
        offset: position of the first query inside its segment; the query at chunk
            position ``i`` sees the segment's keys ``0 .. offset + i``.
        continues: the segments continue a prefix: the call keeps its log-sum-exp for
            the merge with the prefix pass (:class:`_PrefixCall`).
        q_rows, k_rows: the same rows as a slice when they are consecutive (always at
            CP 1 for one segment): read as a view, written in place, no gather.
    """

    q_index: torch.Tensor
    k_index: torch.Tensor
    offset: int
    continues: bool = False
    q_rows: slice | None = None
    k_rows: slice | None = None


@dataclasses.dataclass(frozen=True)
class _PrefixCall:
    """The rows of the continuations of one parent against their common prefix rows,
    every one of which precedes them: one call without a mask.

    Attributes:
        q_index: ``[n]`` local rows of the continuations' queries.
        k_index: ``[k_len]`` positions of the prefix rows in the (gathered) key tensor.
        q_rows, k_rows: the same rows as a slice when they are consecutive.
    """

    q_index: torch.Tensor
    k_index: torch.Tensor
    q_rows: slice | None = None
    k_rows: slice | None = None


@dataclasses.dataclass(frozen=True)
class _Plan:
    key: tuple
    buckets: tuple[_Bucket, ...] = ()
    prefix_calls: tuple[_PrefixCall, ...] = ()
    key_segments: tuple[KeySegment, ...] = ()  # the key-block attention's (key_blocks)
    key_block: int = 0


def _build_plan(
    seg_lens: list[int],
    cp_rank: int,
    cp_size: int,
    device: torch.device,
    prefixes: list[torch.Tensor] | None = None,
    parents: tuple[int, ...] | None = None,
) -> _Plan:
    """Groups the local query chunks of every segment by shape; the continuations' rows
    by parent for the prefix pass.

    Args:
        seg_lens: global (padded) length of every segment, in packing order.
        cp_rank: this rank's index in the CP group.
        cp_size: size of the CP group.
        device: where the index tensors live.
        prefixes: per segment, the packed rows it attends to before its own
            (:func:`megascore.engine.layout.segment_packing.prefix_rows`, rows of the full packed
            axis), or None.
        parents: per segment, its parent (-1: a root), with ``prefixes``.

    Returns:
        The buckets of SDPA calls covering every non-empty segment, and one prefix call
        per parent of continuations.
    """
    n_chunks = 2 * cp_size if cp_size > 1 else 1
    cu = torch.tensor([0, *seg_lens], dtype=torch.long).cumsum(0)
    if cp_size > 1:
        # gathered position of every full packed position: rank j's shard is block j
        order = torch.cat([cp_shard_indices(cu, j, cp_size) for j in range(cp_size)])
        full_to_gathered = torch.empty_like(order)
        full_to_gathered[order] = torch.arange(order.numel())
    else:
        full_to_gathered = torch.arange(int(cu[-1]))

    # (q_len, offset, k_len, continues) -> [(local query start, key rows in the full axis)]
    groups: dict[tuple[int, int, int, bool], list[tuple[int, torch.Tensor]]] = {}
    queries_of: dict[tuple, tuple] = {}  # prefix -> (its rows, the local rows that read it)
    local_start = 0
    for b, length in enumerate(seg_lens):
        if length == 0:
            continue
        if length % n_chunks:
            raise ValueError(
                f"sequence {b}: padded length {length} is not divisible by 2 * cp_size = {n_chunks}"
            )
        chunk = length // n_chunks
        chunk_ids = (cp_rank, n_chunks - 1 - cp_rank) if cp_size > 1 else (0,)
        continues = prefixes is not None and len(prefixes[b]) > 0
        for slot, chunk_id in enumerate(chunk_ids):
            # chunk queries see their segment's rows up to themselves
            keys = int(cu[b]) + torch.arange(chunk_id * chunk + chunk)
            start = local_start + slot * chunk
            groups.setdefault((chunk, chunk_id * chunk, len(keys), continues), []).append(
                (start, keys)
            )
            if continues:  # a parent's children share their prefix rows; a root reads
                # its own cached rows
                owner = ("child", parents[b]) if parents[b] >= 0 else ("root", b)
                queries_of.setdefault(owner, (prefixes[b], []))[1].append(
                    torch.arange(start, start + chunk)
                )
        local_start += len(chunk_ids) * chunk

    buckets = []
    for (q_len, offset, _, continues), entries in sorted(groups.items()):
        q_starts = torch.tensor([e[0] for e in entries], dtype=torch.long)
        q_index = q_starts[:, None] + torch.arange(q_len)  # [n, q_len]
        k_index = full_to_gathered[torch.stack([e[1] for e in entries])]  # [n, k_len]
        fields = _indices(q_index, k_index, device)
        buckets.append(_Bucket(offset=offset, continues=continues, **fields))
    prefix_calls = [
        _PrefixCall(**_indices(torch.cat(rows), full_to_gathered[prefix], device))
        for prefix, rows in queries_of.values()
    ]
    key = (tuple(seg_lens), cp_rank, cp_size, str(device))
    return _Plan(key=key, buckets=tuple(buckets), prefix_calls=tuple(prefix_calls))


def _indices(q_index: torch.Tensor, k_index: torch.Tensor, device) -> dict:
    """A call's query and key indices (on the CPU) as its fields: on ``device``, and as
    slices where the rows are consecutive."""
    return dict(
        q_index=q_index.to(device),
        k_index=k_index.to(device),
        q_rows=_consecutive(q_index),
        k_rows=_consecutive(k_index),
    )


def _consecutive(index: torch.Tensor) -> slice | None:
    """``index`` (any shape, on the CPU) as the slice of rows it lists in order, or None
    when they are not consecutive."""
    flat = index.reshape(-1)
    if not len(flat):
        return None
    start = int(flat[0])
    if not torch.equal(flat, torch.arange(start, start + len(flat))):
        return None
    return slice(start, start + len(flat))


def _take(x: torch.Tensor, index: torch.Tensor, rows: slice | None) -> torch.Tensor:
    """``x[index]``: the rows of ``x`` that ``index`` lists (a view when they are the
    consecutive ``rows``)."""
    if rows is None:
        return x[index]
    return x[rows].reshape(*index.shape, *x.shape[1:])


def _put(x: torch.Tensor, index: torch.Tensor, rows: slice | None, value: torch.Tensor) -> None:
    """``x[index] = value`` (in place into the consecutive ``rows`` when they are)."""
    if rows is None:
        x[index] = value
    else:
        x[rows] = value.reshape(-1, *value.shape[index.dim() :])


class TorchCoreAttention(MegatronModule):
    """Causal core attention with PyTorch SDPA; drop-in for Megatron's ``DotProductAttention``.

    Args:
        config: the transformer config.
        layer_number: 1-based layer index (unused; kept for the spec interface).
        attn_mask_type: must be ``AttnMaskType.causal`` (or ``padding_causal``).
        attention_type: "self" (kept for the spec interface).
        attention_dropout: dropout probability; None = ``config.attention_dropout``.
        softmax_scale: None = ``1 / sqrt(head_dim)``.
        k_channels: query/key head dim (None = ``config.kv_channels``); multi-latent
            attention passes its own (no-RoPE + RoPE dims).
        v_channels: value head dim (None = the key's). MLA's values may be narrower than
            its keys; Megatron pads them to the key dim for THD input and trims after.
        cp_comm_type: ignored (this module always all-gathers K/V).
        pg_collection: process groups; ``tp`` and ``cp`` are used. Required.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        if pg_collection is None:
            raise ValueError("TorchCoreAttention needs an explicit pg_collection (tp and cp)")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"TorchCoreAttention supports causal masks only, got {attn_mask_type}")
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise ValueError("TorchCoreAttention supports vanilla softmax without windows only")
        if config.apply_query_key_layer_scaling:
            raise ValueError("TorchCoreAttention does not support apply_query_key_layer_scaling")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.tp_group = pg_collection.tp
        self.cp_group = pg_collection.cp
        self.head_dim = k_channels if k_channels is not None else config.kv_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        )
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.key_block = 0
        """Query / key block of the key-block attention (0: one call per segment); set with
        the prefix cache (``megascore.engine.cache.setup.configure``)."""
        self.cache_index = -1
        """This module's layer in the prefix cache (``megascore.engine.cache.store``)."""

    def _plan(self, seg_lens: list[int], params: PackedSeqParams | None, device) -> _Plan:
        cp_size = self.cp_group.size() if self.cp_group is not None else 1
        cp_rank = self.cp_group.rank() if cp_size > 1 else 0
        blocked = self.key_block if cp_size == 1 else 0
        key = (tuple(seg_lens), cp_rank, cp_size, str(device), blocked)
        # the plan is shared by every layer of one forward: cache it on the params object
        cached = getattr(params, _PLAN_ATTR, None) if params is not None else None
        if cached is not None and cached.key == key:
            return cached
        prefixes, parents, offsets = None, None, None
        if isinstance(params, SharedPrefixParams):
            prefixes, parents = prefix_rows(params), params.segment_parents
            offsets = params.segment_offsets
        if blocked:
            segments = key_blocks.plan_segments(seg_lens, blocked, device, prefixes, offsets)
            plan = _Plan(key=key, key_segments=segments, key_block=blocked)
        else:
            plan = _build_plan(seg_lens, cp_rank, cp_size, device, prefixes, parents)
        plan = dataclasses.replace(plan, key=key)
        if params is not None:
            setattr(params, _PLAN_ATTR, plan)
        return plan

    def _gather_cp(self, x: torch.Tensor) -> torch.Tensor:
        """All-gathers ``x`` [t, g, d] over the CP group into [cp * t, g, d] (rank-major).

        Megatron's autograd-aware gather (backward: reduce-scatter of the K/V grads).
        """
        if self.cp_group is None or self.cp_group.size() == 1:
            return x
        return gather_from_sequence_parallel_region(x, True, group=self.cp_group)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan):
        """Runs every bucket, then the prefix calls, each merged into its continuations'
        rows by their log-sum-exps. q/k: [t(_k), heads/groups, dim], v: [t_k, groups,
        v_dim] -> [t, heads, v_dim]."""
        if plan.key_block:
            return key_blocks.attend(q, k, v, plan.key_segments, plan.key_block, self.softmax_scale)
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])  # [t, heads, v_dim]
        lse = q.new_zeros(q.shape[:-1], dtype=torch.float32) if plan.prefix_calls else None
        if plan.prefix_calls and self.training and self.dropout_p:
            raise ValueError("shared prefixes need attention dropout 0")
        for bucket in plan.buckets:
            self._run_bucket(q, k, v, bucket, out, lse)
        for call in plan.prefix_calls:
            # [1, heads, n, dim] against [1, groups, k_len, dim]: every prefix row precedes
            ob, lb = attention_with_lse(
                _take(q, call.q_index, call.q_rows).permute(1, 0, 2)[None],
                _take(k, call.k_index, call.k_rows).permute(1, 0, 2)[None],
                _take(v, call.k_index, call.k_rows).permute(1, 0, 2)[None],
                causal=False,
                mask=None,
                scale=self.softmax_scale,
            )
            own_out = _take(out, call.q_index, call.q_rows)
            own_lse = _take(lse, call.q_index, call.q_rows)
            merged = merge(own_out, own_lse, ob[0].permute(1, 0, 2), lb[0].permute(1, 0))
            _put(out, call.q_index, call.q_rows, merged.to(out.dtype))
        return out

    def _run_bucket(self, q, k, v, bucket: _Bucket, out: torch.Tensor, lse) -> None:
        """One bucket's SDPA call into ``out`` (and its log-sum-exps into ``lse`` for
        continuations)."""
        n, q_len = bucket.q_index.shape
        k_len = bucket.k_index.shape[1]
        # qb: [n, heads, q_len, dim]; kb/vb: [n, groups, k_len, dim]
        qb = _take(q, bucket.q_index, bucket.q_rows).permute(0, 2, 1, 3)
        kb = _take(k, bucket.k_index, bucket.k_rows).permute(0, 2, 1, 3)
        vb = _take(v, bucket.k_index, bucket.k_rows).permute(0, 2, 1, 3)
        if bucket.offset == 0 and q_len == k_len:
            mask, causal = None, True
        else:
            # query i (segment position offset + i) sees keys 0 .. offset + i: [q_len, k_len]
            rows = torch.arange(q_len, device=q.device)[:, None] + bucket.offset
            mask = torch.arange(k_len, device=q.device)[None, :] <= rows
            causal = False
        if bucket.continues:
            ob, lb = attention_with_lse(
                qb, kb, vb, causal=causal, mask=mask, scale=self.softmax_scale
            )
            _put(lse, bucket.q_index, bucket.q_rows, lb.permute(0, 2, 1))  # [n, q_len, heads]
        else:
            ob = chunk_attention(
                qb,
                kb,
                vb,
                causal=causal,
                mask=mask,
                scale=self.softmax_scale,
                dropout_p=self.dropout_p if self.training else 0.0,
            )
        # [n, q_len, heads, dim]
        _put(out, bucket.q_index, bucket.q_rows, ob.permute(0, 2, 1, 3).to(out.dtype))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Causal attention over each sequence.

        Args:
            query: THD ``[t, heads, dim]`` or ``[s, b, heads, dim]`` (local heads, local tokens).
            key: ``[t, groups, dim]`` or ``[s, b, groups, dim]``.
            value: same shape as ``key``.
            attention_mask: ignored; the mask is causal per sequence (Megatron passes
                None for THD and a causal mask or None otherwise).
            attn_mask_type: ignored (causal).
            attention_bias: must be None.
            packed_seq_params: THD boundaries (padded ones are used) or None.

        Returns:
            ``[t, heads * dim]`` for THD input, ``[s, b, heads * dim]`` otherwise.
        """
        if attention_bias is not None:
            raise ValueError("TorchCoreAttention does not support attention_bias")
        cp_size = self.cp_group.size() if self.cp_group is not None else 1
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            bounds = cu.tolist()
            seg_lens = [e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
            if sum(seg_lens) != query.shape[0] * cp_size:
                raise ValueError(
                    f"packed boundaries cover {sum(seg_lens)} tokens, the input holds "
                    f"{query.shape[0]} x cp {cp_size}"
                )
            plan = self._plan(seg_lens, packed_seq_params, query.device)
            key, value = self._gather_cp(key), self._gather_cp(value)
            cache = getattr(packed_seq_params, "prefix_cache", None)
            if cache is not None:  # this layer's rows to cache; the cached rows read
                key, value = cache.extend(self.cache_index, key, value)
            out = self._attend(query, key, value, plan)
            return out.reshape(out.shape[0], -1)  # [t, heads * dim]

        # plain [s, b, h, d]: every batch row is one sequence of s * cp tokens
        s, b = query.shape[:2]
        q = query.transpose(0, 1).reshape(b * s, *query.shape[2:])  # [b*s, heads, dim]
        k = key.transpose(0, 1).reshape(b * s, *key.shape[2:])  # [b*s, groups, dim]
        v = value.transpose(0, 1).reshape(b * s, *value.shape[2:])
        plan = self._plan([s * cp_size] * b, None, query.device)
        out = self._attend(q, self._gather_cp(k), self._gather_cp(v), plan)
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()  # [s, b, heads * dim]

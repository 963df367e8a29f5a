"""TorchCoreAttention against a dense per-sequence causal reference, including the zig-zag
context-parallel layout simulated in one process (each "rank" sees the gathered K/V)."""

from __future__ import annotations

import math
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from torch._subclasses.fake_tensor import FakeTensorMode

from megascore.api import layout
from megascore.engine.layout.packing import cp_shard_indices
from megascore.engine.layout.prefix_tree import shared_layout
from megascore.engine.layout.segment_packing import full_positions, pack_layout, prefix_rows
from megascore.model import attention, sdpa
from megascore.model.attention import TorchCoreAttention, _build_plan

HEADS, GROUPS, DIM = 4, 2, 8


class _FakeGroup:
    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _module(cp_size: int = 1, cp_rank: int = 0) -> TorchCoreAttention:
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=DIM,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    pgs = SimpleNamespace(tp=_FakeGroup(1), cp=_FakeGroup(cp_size, cp_rank))
    return TorchCoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=pgs)


def _reference(q, k, v, seg_lens):
    """Dense causal attention per segment in float64. q: [T, H, D], k/v: [T, G, D]."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    rep = HEADS // GROUPS
    start = 0
    for length in seg_lens:
        sl = slice(start, start + length)
        qs, ks, vs = q[sl].double(), k[sl].double(), v[sl].double()
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(DIM)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out[sl] = torch.einsum("hqk,khd->qhd", probs, vs)
        start += length
    return out


def _qkv(total: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(total, HEADS, DIM, generator=gen),
        torch.randn(total, GROUPS, DIM, generator=gen),
        torch.randn(total, GROUPS, DIM, generator=gen),
    )


@pytest.mark.parametrize("seg_lens", [[5, 1, 9, 5, 1], [16], [3, 0, 2]])
def test_packed_matches_per_sequence_reference(seg_lens):
    q, k, v = _qkv(sum(seg_lens))
    module = _module()
    plan = _build_plan(seg_lens, 0, 1, q.device)
    out = module._attend(q, k, v, plan)
    torch.testing.assert_close(out.double(), _reference(q, k, v, seg_lens), atol=1e-5, rtol=0)


def test_equal_lengths_share_one_batched_call():
    plan = _build_plan([4, 7, 4, 4, 7], 0, 1, torch.device("cpu"))
    assert sorted(b.q_index.shape[0] for b in plan.buckets) == [2, 3]


def _zigzag(cp_size: int, q, k, v, seg_lens, device: str = "cpu") -> list[torch.Tensor]:
    """Every CP rank's attention output (the full packed q / k / v cut into the zig-zag
    shards; each rank sees the gathered K/V), in rank order. ``device="cuda"``: on fake
    CUDA tensors (``FakeTensorMode``: shapes, dtypes and devices, no kernel)."""
    cu = torch.tensor([0, *seg_lens]).cumsum(0)
    shards = [cp_shard_indices(cu, r, cp_size) for r in range(cp_size)]
    plans = [_build_plan(seg_lens, r, cp_size, torch.device("cpu")) for r in range(cp_size)]
    k_gathered = torch.cat([k[idx] for idx in shards])  # rank-major, as all_gather gives
    v_gathered = torch.cat([v[idx] for idx in shards])
    mode = FakeTensorMode(allow_non_fake_inputs=True) if device == "cuda" else nullcontext()
    with mode:
        k_gathered, v_gathered = k_gathered.to(device), v_gathered.to(device)
        return [
            _module(cp_size, rank)._attend(q[idx].to(device), k_gathered, v_gathered, plan)
            for rank, (idx, plan) in enumerate(zip(shards, plans, strict=True))
        ]


@pytest.mark.parametrize("cp_size", [2, 3])
def test_zigzag_context_parallel_matches_reference(cp_size):
    seg_lens = [4 * cp_size, 2 * cp_size, 6 * cp_size]
    q, k, v = _qkv(sum(seg_lens), seed=1)
    expected = _reference(q, k, v, seg_lens)
    cu = torch.tensor([0, *seg_lens]).cumsum(0)
    outs = _zigzag(cp_size, q, k, v, seg_lens)
    for rank, out in enumerate(outs):
        idx = cp_shard_indices(cu, rank, cp_size)
        torch.testing.assert_close(out.double(), expected[idx], atol=1e-5, rtol=0)


def _spy_sdpa(monkeypatch) -> list[tuple[bool, int, bool]]:
    """``(masked, K/V heads, enable_gqa)`` of every SDPA call from now on."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, enable_gqa=False, **kwargs):
        calls.append((attn_mask is not None, k.shape[1], enable_gqa))
        return real(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


CP2_SEGMENTS = [8, 4, 12]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_gqa_calls_expand_the_kv_heads_on_cuda_only(monkeypatch, dtype):
    """CP 2's chunks under a mask (and, in float32, the causal ones): on CUDA, where flash
    attention takes no mask / float32 and the memory-efficient kernel no GQA, the K/V heads
    are expanded to the query heads; the CPU keeps ``enable_gqa``. CUDA is faked with
    ``FakeTensorMode`` (shapes and devices, no kernel)."""
    calls = _spy_sdpa(monkeypatch)
    qkv = [t.to(dtype) for t in _qkv(sum(CP2_SEGMENTS))]
    _zigzag(2, *qkv, CP2_SEGMENTS)
    assert set(calls) == {(True, GROUPS, True), (False, GROUPS, True)}
    calls.clear()
    _zigzag(2, *qkv, CP2_SEGMENTS, device="cuda")
    causal = (False, GROUPS, True) if dtype == torch.bfloat16 else (False, HEADS, False)
    assert set(calls) == {(True, HEADS, False), causal}


def test_expanded_kv_heads_give_the_cpus_numbers(monkeypatch):
    """The CUDA form of the masked CP 2 calls (K/V heads expanded, no ``enable_gqa``), run
    on the CPU, equals the CPU's own within float32 rounding on every rank."""
    q, k, v = _qkv(sum(CP2_SEGMENTS), seed=4)
    before = _zigzag(2, q, k, v, CP2_SEGMENTS)
    calls = _spy_sdpa(monkeypatch)
    monkeypatch.setattr(sdpa, "cuda_expands_groups", lambda q, k, mask: mask is not None)
    after = _zigzag(2, q, k, v, CP2_SEGMENTS)
    assert (True, HEADS, False) in calls and (True, GROUPS, True) not in calls
    for a, b in zip(after, before, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_plain_sbhd_input_is_causal_per_batch_row():
    s, b = 6, 3
    q, k, v = _qkv(s * b, seed=2)
    module = _module()
    # [b*s] packed rows -> [s, b, heads, dim]
    out = module(
        q.view(b, s, HEADS, DIM).transpose(0, 1),
        k.view(b, s, GROUPS, DIM).transpose(0, 1),
        v.view(b, s, GROUPS, DIM).transpose(0, 1),
        attention_mask=None,
    )
    assert out.shape == (s, b, HEADS * DIM)
    expected = _reference(q, k, v, [s] * b).view(b, s, HEADS * DIM).transpose(0, 1)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def test_segment_not_divisible_by_cp_chunks_raises():
    with pytest.raises(ValueError, match="sequence 1"):
        _build_plan([4, 6], 0, 2, torch.device("cpu"))


def _shared_case(lead_rows: int, pad: int):
    """Sequences sharing nested prefixes laid out shared (prefix_tree + pack_layout), with
    q / k / v a function of each row's token and position (a lead row repeats its
    parent's row exactly, as in the model)."""
    gen = torch.Generator().manual_seed(3)
    outer, inner = (
        torch.randint(1, 50, (11,), generator=gen),
        torch.randint(1, 50, (7,), generator=gen),
    )
    tails = [torch.randint(1, 50, (n,), generator=gen) for n in (1, 6, 3, 9, 0)]
    seqs = [torch.cat([outer, inner, tails[0]]), torch.cat([outer, inner, tails[1]])]
    seqs += [torch.cat([outer, tails[2]]), torch.cat([outer, tails[3]]), torch.cat([outer, inner])]
    lengths = np.array([len(s) for s in seqs])
    segments = shared_layout(torch.cat(seqs).numpy(), lengths, min_shared=4, lead_rows=lead_rows)
    pad_to = int(layout.padded_lengths(segments.lengths, pad).sum())
    tables = [torch.randn(64, n, DIM, generator=gen) for n in (HEADS, GROUPS, GROUPS)]
    positions = [torch.randn(64, n, DIM, generator=gen) for n in (HEADS, GROUPS, GROUPS)]
    return seqs, segments, pad_to, tables, positions


@pytest.mark.parametrize(("lead_rows", "cp_size"), [(1, 1), (3, 1), (1, 2), (2, 2)])
def test_continuations_match_the_dense_softmax_through_attention_with_lse(
    monkeypatch, lead_rows, cp_size
):
    """Shared prefixes (nested, continuations of 0 and 1 tokens, 1 or 3 lead rows, CP 1
    and 2): every token's output equals its sequence's dense causal attention, and both
    the continuations' own pass and the prefix pass go through ``attention_with_lse``,
    the function the CUDA path calls too (tests/gpu/test_attention_lse.py)."""
    seqs, segments, pad_to, tables, positions = _shared_case(lead_rows, 2 * cp_size)
    calls = []
    real = attention.attention_with_lse

    def spy(q, k, v, **kwargs):
        calls.append(kwargs["causal"] or kwargs["mask"] is not None)  # own pass or prefix pass
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(attention, "attention_with_lse", spy)
    ids = torch.from_numpy(segments.token_ids)
    full = pack_layout(ids, segments, pad_multiple=2 * cp_size, pad_to=pad_to, cp_rank=0, cp_size=1)
    params = full.packed_seq_params
    pos = full_positions(full.cu_seqlens_padded, params)
    tok = torch.zeros(pad_to, dtype=torch.long)
    tok[full.token_positions] = ids
    q, k, v = (t[tok] + p[pos] for t, p in zip(tables, positions, strict=True))
    cu = full.cu_seqlens_padded.long()
    shards = [cp_shard_indices(cu, r, cp_size) for r in range(cp_size)]
    k_gathered, v_gathered = torch.cat([k[i] for i in shards]), torch.cat([v[i] for i in shards])
    out = torch.zeros(pad_to, HEADS, DIM)
    seg_lens = cu.diff().tolist()
    for rank, idx in enumerate(shards):
        plan = _build_plan(
            seg_lens, rank, cp_size, q.device, prefix_rows(params), params.segment_parents
        )
        out[idx] = _module(cp_size, rank)._attend(q[idx], k_gathered, v_gathered, plan)
    assert True in calls and False in calls  # own passes and prefix passes
    rows = full.token_positions[torch.from_numpy(segments.token_rows)]
    start = 0
    for seq in seqs:
        n = len(seq)
        at = torch.arange(n)
        dense = [t[seq] + p[at] for t, p in zip(tables, positions, strict=True)]
        expected = _reference(*dense, [n])
        torch.testing.assert_close(
            out[rows[start : start + n]].double(), expected, atol=1e-5, rtol=0
        )
        start += n

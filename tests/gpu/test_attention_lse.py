"""The torch backend's attention kernels on CUDA (``megascore.model.sdpa``).

``chunk_attention`` (a bucket's plain call) with GQA, causal and as a CP chunk under a
mask, in float32 and bfloat16, runs with the math kernel disabled (the masked GQA call
took it before the K/V heads were expanded on CUDA) and equals a float64 softmax.

The shared-prefix attention kernel: ``attention_with_lse`` (torch's
memory-efficient attention there, flash attention on the CPU) against a float64 softmax,
and its two partial passes merged into the one softmax over all keys.

The same function runs on the CPU in tests/unit/test_torch_attention.py; this proves the
CUDA branch (GQA head expansion, the padded bias, the log-sum-exp's padded length) in the
first device hour (scripts/gpu_check.sh runs tests/gpu).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from megascore.model.sdpa import attention_with_lse, chunk_attention, merge
from testkit.reference import softmax_attention as _reference

pytestmark = pytest.mark.gpu

HEADS, GROUPS, DIM = 8, 2, 64
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_len", "k_len", "offset"), [(37, 37, None), (19, 53, 34), (24, 96, 72)])
def test_gqa_chunks_run_on_flash_or_memory_efficient_attention(dtype, q_len, k_len, offset):
    gen = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(3, HEADS, q_len, DIM, device="cuda", generator=gen).to(dtype)
    k = torch.randn(3, GROUPS, k_len, DIM, device="cuda", generator=gen).to(dtype)
    v = torch.randn(3, GROUPS, k_len, DIM, device="cuda", generator=gen).to(dtype)
    rows = torch.arange(q_len, device="cuda")[:, None] + (offset or 0)
    want = torch.arange(k_len, device="cuda")[None] <= rows  # a CP chunk: keys 0 .. offset + i
    mask = None if offset is None else want
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        out = chunk_attention(q, k, v, causal=offset is None, mask=mask, scale=DIM**-0.5)
    ref_out, _ = _reference(q, k, v, want, DIM**-0.5)
    torch.testing.assert_close(out.double(), ref_out, atol=TOL[dtype], rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("q_len", "k_len", "causal", "offset"),
    [(37, 37, True, 0), (19, 53, False, 34), (40, 300, False, None)],
)
def test_attention_with_lse_on_cuda_matches_the_softmax(dtype, q_len, k_len, causal, offset):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(3, HEADS, q_len, DIM, device="cuda", generator=gen).to(dtype)
    k = torch.randn(3, GROUPS, k_len, DIM, device="cuda", generator=gen).to(dtype)
    v = torch.randn(3, GROUPS, k_len, DIM, device="cuda", generator=gen).to(dtype)
    full = torch.ones(q_len, k_len, dtype=torch.bool, device="cuda")
    if causal:
        mask, want = None, full.tril()
    elif offset is None:  # the prefix pass: every key precedes every query
        mask, want = None, full
    else:  # a CP chunk: query i sees keys 0 .. offset + i
        want = (
            torch.arange(k_len, device="cuda")[None]
            <= torch.arange(q_len, device="cuda")[:, None] + offset
        )
        mask = want
    out, lse = attention_with_lse(q, k, v, causal=causal, mask=mask, scale=DIM**-0.5)
    ref_out, ref_lse = _reference(q, k, v, want, DIM**-0.5)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=TOL[dtype], rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=TOL[dtype], rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_passes_merged_are_the_softmax_over_both():
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, HEADS, 24, DIM, device="cuda", generator=gen)
    prefix = [torch.randn(1, GROUPS, 100, DIM, device="cuda", generator=gen) for _ in "kv"]
    own = [torch.randn(1, GROUPS, 24, DIM, device="cuda", generator=gen) for _ in "kv"]
    a, la = attention_with_lse(q, *prefix, causal=False, mask=None, scale=DIM**-0.5)
    b, lb = attention_with_lse(q, *own, causal=True, mask=None, scale=DIM**-0.5)
    merged = merge(a[0].transpose(0, 1), la[0].T, b[0].transpose(0, 1), lb[0].T)
    keys = [torch.cat([p, o], 2) for p, o in zip(prefix, own, strict=True)]
    want = torch.ones(24, 124, dtype=torch.bool, device="cuda")
    want[:, 100:] = torch.ones(24, 24, dtype=torch.bool, device="cuda").tril()
    ref, _ = _reference(q, *keys, want, DIM**-0.5)
    torch.testing.assert_close(merged.double(), ref[0].transpose(0, 1), atol=2e-5, rtol=0)

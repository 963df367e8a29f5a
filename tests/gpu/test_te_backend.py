"""TransformerEngine attention backend against the portable torch backend (one CUDA rank).

Both models are built from the same seed; weights are layout- and backend-independent
(``megascore.model.weights`` maps TE's fused norm names), so the two must agree up to
kernel rounding. Skipped without CUDA (tests/conftest.py) or without TransformerEngine.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megascore.config import EngineConfig
from megascore.engine.layout.packing import pack_sequences
from megascore.model.build import HAVE_TE, build_model
from megascore.model.config import builtin_model
from megascore.model.parallel import destroy_parallel, initialize_parallel
from tests.packed_forward import forward_packed

pytestmark = pytest.mark.gpu

LENGTHS = [37, 1, 64, 5, 18]
# bf16 activations, different attention kernels: differences are rounding-sized
LOGPROB_TOL = 0.05
METRIC_REL_TOL = 0.02


@pytest.fixture(scope="module")
def pgs():
    if not HAVE_TE:
        pytest.skip("TransformerEngine is not installed")
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    pg_collection = initialize_parallel(EngineConfig(device="cuda"))
    yield pg_collection
    destroy_parallel()
    if created:
        dist.destroy_process_group()


def _run(pgs, model_name: str, backend: str):
    engine_cfg = EngineConfig(device="cuda", dtype="bfloat16", attention_backend=backend)
    model = build_model(builtin_model(model_name), engine_cfg, pgs)
    assert model.megascore_attention_backend == backend
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 512, (sum(LENGTHS),), generator=gen)  # [T], concatenated
    packed = pack_sequences(ids.cuda(), torch.tensor(LENGTHS), pad_individual_seqs_to_multiple_of=8)
    is_moe = builtin_model(model_name).is_moe
    out = forward_packed(model, packed, return_moe_metrics=is_moe, return_mtp_metrics=is_moe)
    starts = packed.cu_seqlens_padded.tolist()
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, LENGTHS, strict=False)])
    logits = out.head.logits(0, out.head.num_tokens)  # [T, V]: a tiny test batch
    logprobs = torch.log_softmax(logits[rows.cuda()].float(), dim=-1)
    return logprobs, {**out.moe_metrics, **out.mtp_metrics}


@pytest.mark.parametrize("model_name", ["tiny", "tiny-moe"])
def test_te_matches_torch_backend(pgs, model_name):
    lp_torch, metrics_torch = _run(pgs, model_name, "torch")
    lp_te, metrics_te = _run(pgs, model_name, "te")
    diff = (lp_te - lp_torch).abs().max().item()
    assert diff <= LOGPROB_TOL, f"max |dlogprob| {diff}"
    assert set(metrics_te) == set(metrics_torch)
    # An MTP acceptance rate is a percentage of tokens: one argmax flipped by a kernel's
    # rounding moves it by 100 / tokens, far more than a relative tolerance allows.
    flip = 2 * 100.0 / sum(LENGTHS)
    for name, value in metrics_torch.items():
        atol = flip if name.endswith("acceptance_rate") else 1e-3
        assert metrics_te[name] == pytest.approx(value, rel=METRIC_REL_TOL, abs=atol), name


def test_te_backend_uses_fused_rope_grouped_experts_and_alltoall(pgs):
    """The TE build runs TE's fused RoPE (THD: no per-layer host sync), grouped-GEMM
    experts and the alltoall MoE dispatcher; test_te_matches_torch_backend checks their
    numbers (same seed: the grouped experts' weights are the sequential ones)."""
    engine_cfg = EngineConfig(device="cuda", dtype="bfloat16", attention_backend="te")
    model = build_model(builtin_model("tiny-moe"), engine_cfg, pgs)
    assert model.config.apply_rope_fusion and model.config.moe_grouped_gemm
    assert model.config.moe_token_dispatcher_type == "alltoall"
    experts = [m for m in model.modules() if type(m).__name__ == "TEGroupedMLP"]
    assert experts, "no TEGroupedMLP in the TE model"
    assert any(n.endswith("experts.linear_fc1.weight0") for n, _ in model.named_parameters())

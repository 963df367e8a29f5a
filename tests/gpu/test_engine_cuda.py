"""The engine on one CUDA rank in bfloat16: tiny and tiny-moe, each attention backend.

Every request feature at once (top-k, every loss, per-sequence temperature, a loss
mask, the MoE / MTP metrics), scored by ``DistributedEngine`` on CUDA in bfloat16
with the torch backend and, where TransformerEngine imports, the TE backend; the
reference is the same engine and weights in float32 (torch backend, the backend
``auto`` picks for float32). bf16 numbers agree to bf16 rounding; counts exactly.
``--lm-head-dtype float32`` changes the logits' rounding only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megascore.api.losses import loss_names
from megascore.api.types import ScoreBatch, ScoreOutput
from megascore.config import EngineConfig
from megascore.engine.runtime import DistributedEngine
from megascore.model.build import HAVE_TE

pytestmark = pytest.mark.gpu

LENGTHS = (37, 1, 64, 5, 18, 120)
TOP_K = 5
BACKENDS = ["torch", pytest.param("te", marks=pytest.mark.skipif(not HAVE_TE, reason="no TE"))]
LOGPROB_TOL = 0.1  # bf16 activations vs float32, two layers, logits of a few nats at most
TOP_K_VALUE_TOL = 0.1
LOSS_RTOL = 0.02
METRIC_RTOL, METRIC_ATOL = 0.1, 1e-3


@pytest.fixture(scope="module", autouse=True)
def world():
    created = not dist.is_initialized()
    if created:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def _batch(moe: bool) -> ScoreBatch:
    rng = np.random.default_rng(5)
    lens = np.array(LENGTHS, dtype=np.int64)
    total = int(lens.sum())
    return ScoreBatch(
        token_ids=rng.integers(0, 512, total).astype(np.int64),
        lengths=lens,
        loss_mask=(rng.random(total) < 0.8).astype(np.uint8),
        temperature=rng.uniform(0.5, 1.5, len(lens)).astype(np.float32),
        top_k=TOP_K,
        losses=loss_names(),
        return_moe_metrics=moe,
        return_mtp_metrics=moe,
    )


def _score(model: str, dtype: str, backend: str, lm_head_dtype: str = "model") -> ScoreOutput:
    cfg = EngineConfig(
        model=model,
        device="cuda",
        dtype=dtype,
        attention_backend=backend,
        lm_head_dtype=lm_head_dtype,
        collective_timeout_s=60,
    )
    engine = DistributedEngine.create(cfg)
    try:
        assert engine.info().attention_backend == backend
        return engine.score(_batch(model == "tiny-moe"))
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def references() -> dict[str, ScoreOutput]:
    return {m: _score(m, "float32", "torch") for m in ("tiny", "tiny-moe")}


def _mtp_acceptance_tol(name: str, value_tol: float) -> float:
    # An acceptance rate is a percentage of tokens: a bf16 rounding that flips one
    # argmax moves it by 100 / tokens; allow two flips.
    return 2 * 100.0 / sum(LENGTHS) if name.endswith("acceptance_rate") else value_tol


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_bf16_engine_matches_float32_reference(references, model, backend):
    ref, out = references[model], _score(model, "bfloat16", backend)
    assert np.isfinite(out.logprobs).all()
    assert np.abs(out.logprobs - ref.logprobs).max() <= LOGPROB_TOL
    # top-k: values sorted as the reference's (ids may swap on near ties)
    assert (out.top_k_ids < 512).all() and (np.diff(out.top_k_logprobs, axis=1) <= 0).all()
    assert np.abs(out.top_k_logprobs - ref.top_k_logprobs).max() <= TOP_K_VALUE_TOL
    pairs = zip(out.top_k_ids, ref.top_k_ids, strict=True)
    overlap = np.mean([len(set(a) & set(b)) / TOP_K for a, b in pairs])
    assert overlap >= 0.6, overlap
    np.testing.assert_array_equal(out.num_loss_tokens, ref.num_loss_tokens)  # the mask
    assert sorted(out.losses) == sorted(ref.losses) == sorted(loss_names())
    for name, values in ref.losses.items():
        np.testing.assert_allclose(out.losses[name], values, rtol=LOSS_RTOL, err_msg=name)
    for group in ("moe_metrics", "mtp_metrics"):
        got, want = getattr(out, group), getattr(ref, group)
        assert sorted(got) == sorted(want), group
        assert bool(want) == (model == "tiny-moe")
        for name, value in want.items():
            atol = _mtp_acceptance_tol(name, METRIC_ATOL)
            assert got[name] == pytest.approx(value, rel=METRIC_RTOL, abs=atol), name


def test_float32_lm_head_changes_only_the_head_rounding(references):
    # Most of the bf16 error comes from the activations; the float32 head removes the
    # logits' own rounding: different numbers, no further from the float32 reference.
    ref = references["tiny"]
    model_head = _score("tiny", "bfloat16", "torch")
    fp32_head = _score("tiny", "bfloat16", "torch", lm_head_dtype="float32")
    assert not np.array_equal(model_head.logprobs, fp32_head.logprobs)
    err_model = np.abs(model_head.logprobs - ref.logprobs).mean()
    err_fp32 = np.abs(fp32_head.logprobs - ref.logprobs).mean()
    assert err_fp32 <= 1.05 * err_model, (err_fp32, err_model)

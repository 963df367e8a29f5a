"""Issue 20 item 3: the MoE router runs in the dtype the family's trainer uses.

Megatron-Bridge's DeepSeek and GLM-MoE providers set ``moe_router_dtype="fp32"``
(``deepseek_provider.py``, ``glm45_provider.py``); its Qwen3-MoE and Mixtral bridges
leave it unset. The HF translations carry that into ``ModelConfig``, the engine's
``--moe-router-dtype`` overrides it, the value reaches Megatron's ``TransformerConfig``,
and a bfloat16 model's router then computes its gating logits and scores in float32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megascore.checkpoint import hf_config_to_model_config
from megascore.config import EngineConfig
from megascore.model.build import build_model, make_transformer_config
from testkit.checkpoints import hf_config
from tests.unit.test_routing_variants import CFG as SIGMOID_ROUTER

# DeepSeek-V3-style: dense first layer, sigmoid router with expert bias and groups
CFG = dataclasses.replace(SIGMOID_ROUTER, moe_router_dtype="fp32")


@pytest.mark.parametrize(
    "family, dtype",
    [("deepseek_v3", "fp32"), ("glm4_moe", "fp32"), ("qwen3_moe", None), ("mixtral", None)],
)
def test_family_router_dtype(family, dtype):
    assert hf_config_to_model_config(hf_config(family).to_dict()).moe_router_dtype == dtype


@pytest.mark.parametrize(
    "override, family_default, want",
    [
        ("auto", "fp32", "fp32"),
        ("auto", None, None),
        ("model", "fp32", None),
        ("fp64", "fp32", "fp64"),
        ("fp32", None, "fp32"),
    ],
)
def test_override_reaches_transformer_config(override, family_default, want):
    model_cfg = dataclasses.replace(CFG, moe_router_dtype=family_default)
    engine_cfg = EngineConfig(dtype="bfloat16", moe_router_dtype=override)
    config = make_transformer_config(model_cfg, engine_cfg, torch.device("cpu"))
    assert config.moe_router_dtype == want


def test_flag_and_bad_value():
    from megascore_server.config_loader import load_serve_config

    config = load_serve_config(["--moe-router-dtype", "model"], environ={})
    assert config.engine.moe_router_dtype == "model"
    with pytest.raises(ValueError, match="moe_router_dtype"):
        EngineConfig(moe_router_dtype="bf16")


def _gating(pgs, override: str):
    """The first MoE router of a bfloat16 model, its gating output on bfloat16 input, and
    the float64 product of the same input and weight."""
    model = build_model(CFG, EngineConfig(dtype="bfloat16", moe_router_dtype=override), pgs)
    router = model.decoder.layers[1].mlp.router
    x = torch.randn(16, CFG.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    with torch.no_grad():
        logits = router.gating(x)
        probs, _ = router.routing(logits.clone())
    exact = x.double() @ router.weight.double().t()
    return logits, probs, exact


def test_route_computed_in_fp32(pgs):
    logits, probs, exact = _gating(pgs, "auto")
    assert logits.dtype == torch.float32 and probs.dtype == torch.float32
    assert (logits.double() - exact).abs().max() < 1e-5
    low, _, exact = _gating(pgs, "model")
    assert low.dtype == torch.bfloat16
    assert (low.double() - exact).abs().max() > 1e-4  # what bf16 gating loses

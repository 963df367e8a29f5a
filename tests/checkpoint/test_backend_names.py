"""Issue 20 item 4: a Megatron checkpoint loads into either attention backend.

The torch backend builds Megatron-Core's local layer spec, TransformerEngine's spec keeps
or fuses the norms elsewhere (``megascore.checkpoint.megatron_names``). TE cannot be built
here: ``tests.checkpoint.te_spec`` builds a CPU model with TE's parameter names, derived
from Megatron-Core 0.19's ``get_gpt_layer_with_transformer_engine_submodules`` (see there).

For a dense, a MoE (+ MTP) and two MLA (DeepSeek-V3: dense first layer, MoE, MTP; with and
without a query down-projection, ``q_lora_rank`` None as in Moonlight) models:
a float32 checkpoint saved by the torch backend carries TE's keys, loads into the
TE-named model in bfloat16 (every fused norm holds the local norm's values) and back;
the TE-named model loaded from it computes the same logits as the torch model; and a
checkpoint in the local spec's own keys (megascore before the map) still loads.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from megascore.checkpoint import hf_config_to_model_config, megatron_ckpt
from megascore.checkpoint.megatron_ckpt import load_checkpoint, save_checkpoint
from megascore.config import EngineConfig
from megascore.model import build, mla
from megascore.model.build import build_model, make_layer_specs, make_transformer_config
from megascore.model.config import builtin_model
from testkit.checkpoints import hf_config, megatron_logprobs, token_batch
from tests.checkpoint.te_spec import te_shaped_model

# TE parameter -> the local spec's parameter holding the same norm (te_spec's docstring).
TE_TO_LOCAL = [
    (r"self_attention\.linear_qkv\.layer_norm_weight$", "input_layernorm.weight"),
    (r"mlp\.linear_fc1\.layer_norm_weight$", "pre_mlp_layernorm.weight"),
    (r"linear_q_up_proj\.layer_norm_weight$", "q_layernorm.weight"),
    (r"linear_kv_up_proj\.layer_norm_weight$", "kv_layernorm.weight"),
]
MODELS = {
    "dense": lambda: builtin_model("tiny"),
    "moe": lambda: builtin_model("tiny-moe"),
    "mla": lambda: hf_config_to_model_config(hf_config("deepseek_v3").to_dict()),
    "mla-q-full": lambda: hf_config_to_model_config(hf_config("deepseek_v3-qfull").to_dict()),
}


def _local_name(te_name: str) -> str:
    for pattern, local in TE_TO_LOCAL:
        if re.search(pattern, te_name):
            return re.sub(pattern, local, te_name)
    return te_name


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def _sharded_keys(model) -> set[str]:
    sharded = model.sharded_state_dict()
    return {
        v.key
        for k, v in sharded.items()
        if isinstance(v, ShardedTensor | ShardedTensorFactory) and "_extra" not in k
    }


@pytest.fixture(params=list(MODELS))
def case(request, pgs, tmp_path):
    cfg = MODELS[request.param]()
    local = build_model(cfg, EngineConfig(device="cpu"), pgs)
    save_checkpoint(local, cfg, tmp_path / "torch")
    return request.param, cfg, local, tmp_path


def test_torch_checkpoint_loads_into_te_names_in_bf16_and_back(case, pgs):
    name, cfg, local, tmp_path = case
    te = te_shaped_model(cfg, EngineConfig(device="cpu", dtype="bfloat16"), pgs)
    stored = set(dist_checkpointing.load_tensors_metadata(str(tmp_path / "torch")))
    assert stored == _sharded_keys(te), name  # the torch backend wrote TE's keys
    load_checkpoint(te, cfg, tmp_path / "torch")
    want = _params(local)
    got = _params(te)
    assert {_local_name(n) for n in got} == set(want), name
    fused = [n for n in got if _local_name(n) != n]
    assert fused, name
    assert all(p.dtype == torch.bfloat16 for p in te.parameters())
    for te_name, value in got.items():  # (the router's expert-bias buffer stays float32)
        assert torch.equal(value, want[_local_name(te_name)].to(value.dtype)), te_name

    save_checkpoint(te, cfg, tmp_path / "te")  # and back, into a model with other weights
    other = build_model(cfg, EngineConfig(device="cpu", seed=99), pgs)
    load_checkpoint(other, cfg, tmp_path / "te")
    for local_name, value in _params(other).items():
        te_name = next(n for n in got if _local_name(n) == local_name)
        assert torch.equal(value, got[te_name].float()), local_name


def test_te_named_model_computes_the_same(case, pgs):
    name, cfg, local, tmp_path = case
    te = te_shaped_model(cfg, EngineConfig(device="cpu"), pgs)
    load_checkpoint(te, cfg, tmp_path / "torch")
    ids = token_batch()
    want = megatron_logprobs(local, ids, pgs.tp)
    np.testing.assert_allclose(megatron_logprobs(te, ids, pgs.tp), want, rtol=0, atol=1e-5)


def test_checkpoint_with_local_keys_still_loads(case, pgs, monkeypatch):
    name, cfg, local, tmp_path = case
    with monkeypatch.context() as m:
        m.setattr(megatron_ckpt, "_to_te_keys", lambda sharded, stored=None: None)
        save_checkpoint(local, cfg, tmp_path / "old")
    stored = set(dist_checkpointing.load_tensors_metadata(str(tmp_path / "old")))
    te_keys = set(dist_checkpointing.load_tensors_metadata(str(tmp_path / "torch")))
    # the local spec's keys map already gives a dense GQA layer TE's keys
    assert (stored != te_keys) == (name != "dense"), name
    other = build_model(cfg, EngineConfig(device="cpu", seed=99), pgs)
    load_checkpoint(other, cfg, tmp_path / "old")
    want = _params(local)
    assert all(torch.equal(v, want[k]) for k, v in _params(other).items()), name


def test_te_spec_keeps_the_plain_query_projection_without_q_lora(pgs, monkeypatch):
    """MLA without a query down-projection: Megatron's resolver on TE's layers fuses a norm
    into ``linear_q_proj`` (no checkpoint holds its weight, transformers has no such norm);
    megascore's MLA keeps the spec's plain projection, the kv norm in ``linear_kv_up_proj``."""
    cfg = MODELS["mla-q-full"]()
    te = te_shaped_model(cfg, EngineConfig(device="cpu"), pgs)
    names = set(_params(te))
    assert any(n.endswith("linear_q_proj.weight") for n in names)
    assert any(n.endswith("linear_kv_up_proj.layer_norm_weight") for n in names)
    assert not any("linear_q_proj.layer_norm" in n or "kv_layernorm" in n for n in names)
    megatrons = mla.MLASelfAttention._resolve_qk_norm_config
    monkeypatch.setattr(mla.PlainQueryMLASelfAttention, "_resolve_qk_norm_config", megatrons)
    stock = te_shaped_model(cfg, EngineConfig(device="cpu"), pgs)
    assert any(n.endswith("linear_q_proj.layer_norm_weight") for n in _params(stock))


def test_both_backends_build_mla_with_the_plain_query_projection(monkeypatch):
    """The TE branch of ``make_layer_specs`` swaps in the same MLA module as the torch one
    (TE's spec cannot be built here: the local spec stands in for it)."""
    real = build.get_gpt_decoder_block_spec
    flags = []

    def local_spec(config, use_transformer_engine, **kwargs):
        flags.append(use_transformer_engine)
        return real(config, use_transformer_engine=False, **kwargs)

    monkeypatch.setattr(build, "get_gpt_decoder_block_spec", local_spec)
    cfg = dataclasses.replace(MODELS["mla-q-full"](), mtp_num_layers=None)
    config = make_transformer_config(cfg, EngineConfig(device="cpu"), torch.device("cpu"))
    for backend in ("te", "torch"):
        block, _ = make_layer_specs(config, backend)
        modules = {s.submodules.self_attention.module for s in block.layer_specs}
        assert modules == {mla.PlainQueryMLASelfAttention}, backend
    assert flags == [True, False]

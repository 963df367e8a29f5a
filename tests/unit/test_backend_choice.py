"""Issue 16, fix 1: the attention backend follows the dtype; `te` that cannot run fails at start-up.

TransformerEngine's fused / flash attention have no float32 kernel for packed (THD)
sequences, so ``auto`` picks ``te`` only for bfloat16 / float16 on CUDA where TE imports,
and an explicit ``te`` is refused up front (config, then the backend choice) instead of
answering SERVING and failing the first Score. ``HAVE_TE`` is patched to cover the GPU
branches on this CPU machine; the device is only inspected, never used.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from megascore.config import EngineConfig
from megascore.model import build
from megascore.model.build import resolve_attention_backend
from megascore.model.config import builtin_model
from megascore_server.config_loader import load_serve_config
from megascore_server.main import main

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("have_te", "device", "dtype", "want"),
    [
        (True, CUDA, "bfloat16", "te"),
        (True, CUDA, "float16", "te"),
        (True, CUDA, "float32", "torch"),  # the default dtype: TE would fail the first Score
        (True, CPU, "bfloat16", "torch"),
        (False, CUDA, "bfloat16", "torch"),
        (False, CPU, "float32", "torch"),
    ],
)
def test_auto_picks_te_only_for_half_precision_on_cuda(monkeypatch, have_te, device, dtype, want):
    monkeypatch.setattr(build, "HAVE_TE", have_te)
    cfg = EngineConfig(attention_backend="auto", dtype=dtype)
    assert resolve_attention_backend(cfg, device) == want


def test_te_with_float32_is_refused_by_the_config():
    with pytest.raises(ValueError, match="'te' needs dtype bfloat16 or float16"):
        EngineConfig(attention_backend="te", dtype="float32")


def test_serve_refuses_te_with_float32_before_starting(capsys):
    with pytest.raises(ValueError, match="bfloat16"):
        load_serve_config(["--attention-backend", "te"], environ={})  # dtype default float32
    assert main(["--attention-backend", "te", "--dtype", "float32"]) == 2
    assert "--attention-backend torch" in capsys.readouterr().err


def test_explicit_te_is_checked_at_start_up(monkeypatch):
    monkeypatch.setattr(build, "HAVE_TE", False)
    cfg = EngineConfig(attention_backend="te", dtype="bfloat16")
    with pytest.raises(ValueError, match="TransformerEngine is not importable"):
        resolve_attention_backend(cfg, CUDA)
    monkeypatch.setattr(build, "HAVE_TE", True)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_attention_backend(cfg, CPU)
    assert resolve_attention_backend(cfg, CUDA) == "te"
    cfg.dtype = "float32"  # set after validation: the backend choice checks it again
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        resolve_attention_backend(cfg, CUDA)


def test_torch_backend_is_allowed_everywhere(monkeypatch):
    monkeypatch.setattr(build, "HAVE_TE", True)
    for dtype in ("float32", "bfloat16"):
        cfg = EngineConfig(attention_backend="torch", dtype=dtype)
        assert resolve_attention_backend(cfg, CUDA) == "torch"


def test_lm_head_dtype_flag():
    assert EngineConfig().lm_head_dtype == "model"
    config = load_serve_config(["--lm-head-dtype", "float32"], environ={})
    assert config.engine.lm_head_dtype == "float32"
    with pytest.raises(ValueError, match="lm_head_dtype"):
        EngineConfig(lm_head_dtype="float64")


def test_gpu_image_default_command_runs_te_in_bfloat16(monkeypatch):
    dockerfile = (Path(__file__).resolve().parents[2] / "docker" / "Dockerfile").read_text()
    cmd = json.loads(next(line for line in dockerfile.splitlines() if line.startswith("CMD "))[4:])
    config = load_serve_config(cmd, environ={"MEGASCORE_DEVICE": "cuda"})
    assert config.engine.device == "cuda" and config.engine.dtype == "bfloat16"
    monkeypatch.setattr(build, "HAVE_TE", True)
    assert resolve_attention_backend(config.engine, CUDA) == "te"


def test_moe_tokens_dispatched_with_alltoall_on_cuda_allgather_on_cpu():
    """Data-parallel ranks score different tokens: on CUDA each EP rank sends its tokens to
    the experts' ranks (alltoall); the CPU keeps the allgather dispatcher (alltoall creates
    CUDA streams). Only the config is built: nothing touches the device."""
    model_cfg = builtin_model("tiny-moe")
    engine_cfg = EngineConfig(model="tiny-moe")
    cuda = build.make_transformer_config(model_cfg, engine_cfg, CUDA)
    cpu = build.make_transformer_config(model_cfg, engine_cfg, CPU)
    assert cuda.moe_token_dispatcher_type == "alltoall"
    assert cpu.moe_token_dispatcher_type == "allgather"


def test_te_backend_fuses_rope_except_for_mla_and_groups_experts():
    """TE's fused RoPE on the TE backend (not for MLA: 0.19 fuses MLA RoPE in training only)
    and grouped-GEMM experts for MoE models; the torch backend keeps Megatron's unfused
    RoPE and one GEMM per expert (both fused kernels are TE's)."""
    dense = builtin_model("tiny")
    mla = dataclasses.replace(dense, multi_latent_attention=True)
    assert build.te_fusions(dense) == {"apply_rope_fusion": True, "moe_grouped_gemm": False}
    assert build.te_fusions(mla)["apply_rope_fusion"] is False
    assert build.te_fusions(builtin_model("tiny-moe"))["moe_grouped_gemm"] is True
    torch_cfg = build.make_transformer_config(dense, EngineConfig(), CUDA, "torch")
    assert torch_cfg.apply_rope_fusion is False
    moe_cfg = build.make_transformer_config(builtin_model("tiny-moe"), EngineConfig(), CUDA)
    assert moe_cfg.moe_grouped_gemm is False

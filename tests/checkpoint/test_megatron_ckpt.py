"""Megatron distributed checkpoints on one rank: round trip, dtype, versions, errors."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from megascore.api.errors import CheckpointError
from megascore.checkpoint import resolve_model
from megascore.checkpoint.megatron_ckpt import CONFIG_FILE, load_checkpoint, save_checkpoint
from megascore.model.config import builtin_model
from testkit.checkpoints import megatron_logprobs, token_batch


def _tensors(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_round_trip_is_exact(hf_dirs, tmp_path, build, pgs, family):
    cfg, load, _ = resolve_model(f"hf:{hf_dirs[family]}")
    model = build(cfg)
    load(model)
    save_checkpoint(model, cfg, tmp_path / "ckpt", weights_version="step-42")
    saved = json.loads((tmp_path / "ckpt" / CONFIG_FILE).read_text())
    assert saved["model_config"]["architecture"] == family

    cfg2, load2, meta = resolve_model(f"megatron:{tmp_path / 'ckpt'}")
    assert cfg2 == cfg
    assert (meta.kind, meta.weights_version, meta.checkpoint_dtype) == (
        "megatron",
        "step-42",
        "float32",
    )
    fresh = build(cfg2)
    load2(fresh)
    want, got = _tensors(model), _tensors(fresh)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    ids = token_batch()
    assert np.array_equal(
        megatron_logprobs(model, ids, pgs.tp), megatron_logprobs(fresh, ids, pgs.tp)
    )


def test_builtin_model_round_trip_into_bf16(tmp_path, build):
    cfg = builtin_model("tiny")
    model = build(cfg)
    save_checkpoint(model, cfg, tmp_path / "ckpt")
    cfg2, load2, meta = resolve_model(f"megatron:{tmp_path / 'ckpt'}")
    assert len(meta.weights_version) == 16  # file fingerprint when no label was given
    bf16 = build(cfg2, dtype="bfloat16")
    load2(bf16)
    src, dst = _tensors(model), _tensors(bf16)
    for name, value in src.items():
        assert torch.equal(dst[name], value.to(dst[name].dtype)), name


def test_refuses_non_empty_dir_and_incomplete_checkpoint(tmp_path, build):
    cfg = builtin_model("tiny")
    model = build(cfg)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        save_checkpoint(model, cfg, tmp_path / "full")
    save_checkpoint(model, cfg, tmp_path / "ckpt")
    (tmp_path / "ckpt" / CONFIG_FILE).unlink()
    with pytest.raises(CheckpointError, match="megascore.json: missing"):
        resolve_model(f"megatron:{tmp_path / 'ckpt'}")


def test_architecture_mismatch_and_corrupt_data_leave_model(tmp_path, build):
    cfg = builtin_model("tiny")
    model = build(cfg)
    save_checkpoint(model, cfg, tmp_path / "ckpt")
    other_cfg = dataclasses.replace(cfg, ffn_hidden_size=96, seed=7)
    other = build(other_cfg)
    before = _tensors(other)
    with pytest.raises(CheckpointError, match="ffn_hidden_size: 128 != 96"):
        load_checkpoint(other, other_cfg, tmp_path / "ckpt")
    # a checkpoint whose data file lost its tail
    data_file = next((tmp_path / "ckpt").glob("*.distcp"))
    with open(data_file, "r+b") as f:
        f.truncate(data_file.stat().st_size // 2)
    same = build(dataclasses.replace(cfg, seed=7))
    before = _tensors(same)
    with pytest.raises(CheckpointError, match="cannot load distributed checkpoint"):
        load_checkpoint(same, cfg, tmp_path / "ckpt")
    after = _tensors(same)
    assert all(torch.equal(before[k], after[k]) for k in before)

"""Block-scaled FP8 safetensors (DeepSeek-V3 layout): slices dequantised exactly, bad
layouts and other quantisations refused with the tensor or field named."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from megascore.api.errors import CheckpointError
from megascore.checkpoint import fp8, hf_config_to_model_config
from megascore.checkpoint.safetensors_io import SafetensorsDir
from testkit.checkpoints import hf_config, quantize_block_fp8

BLOCK = (32, 24)


def _write(directory, tensors):
    directory.mkdir(exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def _stored(shape=(70, 50), seed=0):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    q, scale_inv = quantize_block_fp8(w, BLOCK)
    expanded = scale_inv.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
    return q, scale_inv, q.float() * expanded[: shape[0], : shape[1]], w


def test_slices_dequantise_to_the_blocks_values(tmp_path):
    q, scale_inv, real, w = _stored()
    reader = SafetensorsDir(_write(tmp_path, {"w": q, "w_scale_inv": scale_inv}), BLOCK)
    assert reader.names() == ["w"] and reader.dtype("w") == "F8_E4M3"
    torch.testing.assert_close(reader.read("w"), real, rtol=0, atol=0)
    for index in [(slice(5, 61),), (slice(31, 33), slice(23, 50)), (7, slice(10, 49)), (69,)]:
        torch.testing.assert_close(reader.read("w", index), real[index], rtol=0, atol=0)
    assert (real - w).abs().max() < 0.1 * w.abs().max()  # FP8 rounding, not garbage


def test_bad_fp8_layouts_name_the_tensor(tmp_path):
    q, scale_inv, _, _ = _stored()
    with pytest.raises(CheckpointError, match="'w' has no 'w_scale_inv'"):
        SafetensorsDir(_write(tmp_path / "a", {"w": q}), BLOCK)
    with pytest.raises(CheckpointError, match="'w_scale_inv' has shape"):
        SafetensorsDir(_write(tmp_path / "b", {"w": q, "w_scale_inv": scale_inv[:1]}), BLOCK)
    reader = SafetensorsDir(_write(tmp_path / "c", {"w": q, "w_scale_inv": scale_inv}))
    with pytest.raises(CheckpointError, match="no quantization_config"):
        reader.read("w")


def test_quantization_config_is_read_or_refused():
    config = hf_config("deepseek_v3").to_dict()
    assert fp8.block_size(config) is None
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert fp8.block_size(config) == (128, 128)
    hf_config_to_model_config(json.loads(json.dumps(config)))
    bad = [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ]
    for quant, match in bad:
        config["quantization_config"] = quant
        with pytest.raises(CheckpointError, match=match):
            hf_config_to_model_config(config)

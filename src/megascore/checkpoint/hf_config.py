"""Hugging Face ``config.json`` -> :class:`~megascore.model.config.ModelConfig` (torch-free).

Supported families (``model_type``): ``llama``, ``mistral``, ``qwen2``, ``qwen3``
(dense), ``mixtral``, ``qwen3_moe`` (softmax-router MoE), ``deepseek_v3`` (multi-latent
attention, sigmoid router, MTP) and ``glm4_moe`` (sigmoid router, MTP). Each family's
translation lives in :mod:`megascore.checkpoint.families`; see docs/checkpoints.md for
what each maps onto in Megatron-Core.

A config value Megatron-Core would compute differently from the HF reference (another
activation, biases it has no place for, other RoPE scalings, other routers) raises
:class:`~megascore.api.errors.CheckpointError` naming the field, rather than loading a model
that would silently score differently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megascore.api.errors import CheckpointError
from megascore.checkpoint import fp8
from megascore.checkpoint.families import ARCHITECTURES, TRANSLATORS
from megascore.model.config import ModelConfig

SUPPORTED_MODEL_TYPES = tuple(TRANSLATORS)


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """Reads ``DIR/config.json``.

    Args:
        directory: HF checkpoint directory.

    Returns:
        The parsed JSON object.

    Raises:
        CheckpointError: the file is missing or is not a JSON object.
    """
    path = Path(directory) / "config.json"
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json in the HF checkpoint directory") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read config.json: {e}") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: config.json is not a JSON object")
    return config


def model_type_of(config: dict[str, Any]) -> str:
    """Returns the HF ``model_type`` of a config (falling back to ``architectures``)."""
    model_type = config.get("model_type")
    if not model_type:
        for arch in config.get("architectures") or ():
            if arch in ARCHITECTURES:
                return ARCHITECTURES[arch]
        raise CheckpointError(
            "config.json has no model_type; supported architectures: "
            + ", ".join(SUPPORTED_MODEL_TYPES)
        )
    return str(model_type)


def hf_config_to_model_config(config: dict[str, Any]) -> ModelConfig:
    """Translates a HF ``config.json`` object into a :class:`ModelConfig`.

    Args:
        config: the parsed ``config.json``.

    Returns:
        The Megatron architecture config with ``architecture`` set to the HF model type.

    Raises:
        CheckpointError: unsupported family or feature (a quantisation other than
            block-scaled FP8 too), or a required field is missing.
    """
    fp8.block_size(config)  # refuses what cannot be dequantised, before any file is read
    model_type = model_type_of(config)
    if model_type not in TRANSLATORS:
        raise CheckpointError(
            f"HF model_type {model_type!r} is not supported; supported architectures: "
            + ", ".join(f"{t} ({a})" for a, t in ARCHITECTURES.items())
        )
    kwargs = TRANSLATORS[model_type](config)
    try:
        return ModelConfig(**kwargs)
    except ValueError as e:
        raise CheckpointError(f"config.json: inconsistent architecture: {e}") from e

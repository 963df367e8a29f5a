"""Checkpoint loading: HF safetensors and Megatron distributed checkpoints.

Torch-free to import; the weight readers import torch / Megatron when used.

* :func:`parse_model_string` is the one model-string grammar (:class:`ModelSpec`).
* :func:`resolve_model` turns ``tiny[@SEED]`` / ``hf:DIR`` / ``megatron:DIR`` into
  ``(ModelConfig, load_weights, CheckpointMetadata)`` without reading weights.
* :func:`read_model_config` reads only the architecture (the config file), and
  :func:`check_same_architecture` is the one architecture comparison (hot reload;
  the engine's reload path is :mod:`megascore.engine.weights.served_model`).
* ``megascore.checkpoint.megatron_ckpt.save_checkpoint`` writes a checkpoint
  that loads into any TP / CP / EP layout (also the way to convert HF -> Megatron).
"""

from megascore.checkpoint.checks import check_same_architecture
from megascore.checkpoint.hf_config import SUPPORTED_MODEL_TYPES, hf_config_to_model_config
from megascore.checkpoint.resolve import (
    CheckpointMetadata,
    ModelSpec,
    ResolvedModel,
    parse_model_string,
    read_model_config,
    resolve_model,
)
from megascore.deferred_compile import install as _defer_megatron_compile

_defer_megatron_compile()  # before any module here imports Megatron-Core (hf_bridge, ...)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "CheckpointMetadata",
    "ModelSpec",
    "ResolvedModel",
    "check_same_architecture",
    "hf_config_to_model_config",
    "parse_model_string",
    "read_model_config",
    "resolve_model",
]

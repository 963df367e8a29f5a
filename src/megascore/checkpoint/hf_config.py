"""Hugging Face ``config.json`` -> :class:`~megascore.model.config.ModelConfig` (torch-free).

Supported families (``model_type``): ``llama``, ``mistral``, ``qwen2`` (dense) and
``mixtral`` (MoE). Each maps onto Megatron-Core's GPT model with RMSNorm, SwiGLU,
RoPE (non-interleaved, as HF's ``rotate_half``) and grouped-query attention:

* qwen2 adds a bias on the fused QKV projection only (``add_qkv_bias``).
* mixtral replaces the MLP by ``num_local_experts`` SwiGLU experts with a
  softmax top-k router; HF renormalises the top-k softmax probabilities, which
  is what Megatron computes with ``moe_router_pre_softmax=False`` (top-k on the
  logits, then softmax over the k).
* Llama-3.x RoPE frequency scaling (``rope_type: llama3``) is accepted when its
  ``low_freq_factor``/``high_freq_factor``/``original_max_position_embeddings``
  equal the values Megatron hard-codes (1, 4, 8192).
* Sliding-window attention (mistral / mixtral ``sliding_window``) equals full
  causal attention for sequences no longer than the window, so the served
  ``max_position_embeddings`` is capped at the window.

Anything else (other activations, biases on other projections, other RoPE
scalings) raises :class:`~megascore.errors.CheckpointError` rather than loading
a model that would silently score differently from the HF reference.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from megascore.errors import CheckpointError
from megascore.model.config import ModelConfig

logger = logging.getLogger(__name__)

DENSE_FAMILIES = ("llama", "mistral", "qwen2")
MOE_FAMILIES = ("mixtral",)
SUPPORTED_MODEL_TYPES = DENSE_FAMILIES + MOE_FAMILIES

_ARCHITECTURE_TO_MODEL_TYPE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
}

# Megatron's RotaryEmbedding._apply_scaling hard-codes these Llama-3 parameters.
_MEGATRON_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


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
            if arch in _ARCHITECTURE_TO_MODEL_TYPE:
                return _ARCHITECTURE_TO_MODEL_TYPE[arch]
        raise CheckpointError(
            "config.json has no model_type; supported architectures: "
            + ", ".join(SUPPORTED_MODEL_TYPES)
        )
    return str(model_type)


def _require(config: dict[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise CheckpointError(f"config.json: required field {key!r} is missing")
    return config[key]


def _rope(config: dict[str, Any]) -> tuple[float, bool, float]:
    """Returns (rotary_base, rope_scaling, rope_scaling_factor) from either config layout.

    transformers < 5 writes ``rope_theta`` + ``rope_scaling``; transformers 5 writes
    ``rope_parameters`` (``{"rope_theta": ..., "rope_type": ...}``).
    """
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"config.json: rope parameters must be an object, got {params!r}")
    base = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        return float(base), False, 8.0
    if rope_type != "llama3":
        raise CheckpointError(
            f"config.json: rope_type {rope_type!r} is not supported (only default and llama3)"
        )
    for key, want in _MEGATRON_LLAMA3_ROPE.items():
        if key in params and float(params[key]) != float(want):
            raise CheckpointError(
                f"config.json: llama3 rope {key}={params[key]} is not supported "
                f"(Megatron-Core implements {key}={want})"
            )
    return float(base), True, float(_require(params, "factor"))


def _check_unsupported(config: dict[str, Any], model_type: str) -> None:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"config.json: hidden_act {act!r} is not supported (only silu)")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise CheckpointError(f"config.json: {key}=true is not supported for {model_type}")
    if config.get("num_nextn_predict_layers"):
        raise CheckpointError("config.json: MTP layers (num_nextn_predict_layers) not supported")


def _sliding_window(config: dict[str, Any], model_type: str) -> int | None:
    if model_type == "qwen2" and not config.get("use_sliding_window", False):
        return None
    window = config.get("sliding_window")
    return int(window) if window else None


def hf_config_to_model_config(config: dict[str, Any]) -> ModelConfig:
    """Translates a HF ``config.json`` object into a :class:`ModelConfig`.

    Args:
        config: the parsed ``config.json``.

    Returns:
        The Megatron architecture config with ``architecture`` set to the HF model type.

    Raises:
        CheckpointError: unsupported family or feature, or a required field is missing.
    """
    model_type = model_type_of(config)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"HF model_type {model_type!r} is not supported; supported architectures: "
            + ", ".join(f"{t} ({a})" for a, t in _ARCHITECTURE_TO_MODEL_TYPE.items())
        )
    _check_unsupported(config, model_type)
    hidden = int(_require(config, "hidden_size"))
    heads = int(_require(config, "num_attention_heads"))
    head_dim = config.get("head_dim") or None
    rotary_base, rope_scaling, rope_factor = _rope(config)
    max_pos = int(config.get("max_position_embeddings") or 4096)
    window = _sliding_window(config, model_type)
    if window is not None and window < max_pos:
        logger.info(
            "%s: sliding_window=%d < max_position_embeddings=%d: serving at most %d tokens "
            "(full causal attention equals the sliding window up to that length)",
            model_type,
            window,
            max_pos,
            window,
        )
        max_pos = window
    kwargs: dict[str, Any] = dict(
        num_layers=int(_require(config, "num_hidden_layers")),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(config.get("num_key_value_heads") or heads),
        kv_channels=int(head_dim) if head_dim else None,
        vocab_size=int(_require(config, "vocab_size")),
        ffn_hidden_size=int(_require(config, "intermediate_size")),
        max_position_embeddings=max_pos,
        normalization="RMSNorm",
        layernorm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation="silu",
        add_bias_linear=False,
        add_qkv_bias=model_type == "qwen2",
        position_embedding_type="rope",
        rotary_base=rotary_base,
        rope_scaling=rope_scaling,
        rope_scaling_factor=rope_factor,
        share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings", False)),
        init_method_std=float(config.get("initializer_range", 0.02)),
        architecture=model_type,
    )
    if model_type == "mixtral":
        kwargs.update(
            num_moe_experts=int(_require(config, "num_local_experts")),
            moe_router_topk=int(config.get("num_experts_per_tok", 2)),
            moe_ffn_hidden_size=int(_require(config, "intermediate_size")),
            moe_router_score_function="softmax",
            moe_router_pre_softmax=False,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0) or 0.0),
        )
    try:
        return ModelConfig(**kwargs)
    except ValueError as e:
        raise CheckpointError(f"config.json: inconsistent architecture: {e}") from e


def model_config_from_hf_dir(directory: str | Path) -> ModelConfig:
    """Reads ``DIR/config.json`` and translates it (see :func:`hf_config_to_model_config`)."""
    return hf_config_to_model_config(read_hf_config(directory))

"""Config-translation helpers shared by the Hugging Face families (torch-free).

Every family translator in this package turns a HF ``config.json`` object into the
keyword arguments of :class:`~megascore.model.config.ModelConfig`; these helpers
read the fields all of them share (sizes, RMSNorm, SiLU, RoPE, tied embeddings)
and raise :class:`~megascore.api.errors.CheckpointError` for a value Megatron-Core
would compute differently from the HF reference.
"""

from __future__ import annotations

import logging
from typing import Any

from megascore.api.errors import CheckpointError

logger = logging.getLogger(__name__)

Config = dict[str, Any]

# Megatron's RotaryEmbedding._apply_scaling hard-codes these Llama-3 parameters.
_MEGATRON_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def require(config: Config, key: str) -> Any:
    """``config[key]``; raises CheckpointError naming the key when it is missing or null."""
    if config.get(key) is None:
        raise CheckpointError(f"config.json: required field {key!r} is missing")
    return config[key]


def refuse_if(condition: bool, message: str) -> None:
    """Raises ``CheckpointError("config.json: <message>")`` when ``condition`` holds."""
    if condition:
        raise CheckpointError(f"config.json: {message}")


def rope_parameters(config: Config) -> dict[str, Any]:
    """The RoPE parameters in either layout: transformers < 5 writes ``rope_theta`` +
    ``rope_scaling``; transformers 5 writes ``rope_parameters`` (with ``rope_theta`` and
    ``rope_type`` inside). Returns a dict with at least ``rope_theta`` and ``rope_type``."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"config.json: rope parameters must be an object, got {params!r}")
    params = dict(params)
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    if "partial_rotary_factor" not in params and "partial_rotary_factor" in config:
        params["partial_rotary_factor"] = config["partial_rotary_factor"]
    return params


def standard_rope(config: Config) -> dict[str, Any]:
    """ModelConfig RoPE fields of a GPT-style (non-MLA) family: default or Llama-3 scaling,
    optionally partial (``partial_rotary_factor``)."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    out: dict[str, Any] = {"rotary_base": float(params["rope_theta"])}
    factor = params.get("partial_rotary_factor")
    if factor is not None:
        refuse_if(not 0 < float(factor) <= 1, f"partial_rotary_factor {factor} must be in (0, 1]")
        out["rotary_percent"] = float(factor)
    if rope_type == "default":
        return out
    refuse_if(
        rope_type != "llama3",
        f"rope_type {rope_type!r} is not supported for this family (only default and llama3)",
    )
    for key, want in _MEGATRON_LLAMA3_ROPE.items():
        refuse_if(
            key in params and float(params[key]) != float(want),
            f"llama3 rope {key}={params.get(key)} is not supported "
            f"(Megatron-Core implements {key}={want})",
        )
    return dict(out, rope_scaling=True, rope_scaling_factor=float(require(params, "factor")))


def check_silu(config: Config) -> None:
    act = config.get("hidden_act", "silu")
    refuse_if(act != "silu", f"hidden_act {act!r} is not supported (only silu)")


def max_length(config: Config, model_type: str, *, uses_window_flag: bool) -> int:
    """``max_position_embeddings``, capped at the sliding window when one applies.

    Sliding-window attention equals full causal attention for sequences no longer than
    the window, so a windowed model is served up to the window length. Families with a
    ``use_sliding_window`` switch (qwen2, qwen3) apply the window only when it is on.
    """
    max_pos = int(config.get("max_position_embeddings") or 4096)
    window = config.get("sliding_window")
    if uses_window_flag and not config.get("use_sliding_window", False):
        window = None
    if window and int(window) < max_pos:
        logger.info(
            "%s: sliding_window=%d < max_position_embeddings=%d: serving at most %d tokens "
            "(full causal attention equals the sliding window up to that length)",
            model_type,
            int(window),
            max_pos,
            int(window),
        )
        max_pos = int(window)
    return max_pos


def decoder_kwargs(config: Config, model_type: str) -> dict[str, Any]:
    """Fields every family shares: sizes, RMSNorm, SwiGLU, embeddings, init std, label."""
    check_silu(config)
    refuse_if(bool(config.get("mlp_bias")), f"mlp_bias=true is not supported for {model_type}")
    return dict(
        num_layers=int(require(config, "num_hidden_layers")),
        hidden_size=int(require(config, "hidden_size")),
        num_attention_heads=int(require(config, "num_attention_heads")),
        vocab_size=int(require(config, "vocab_size")),
        ffn_hidden_size=int(require(config, "intermediate_size")),
        normalization="RMSNorm",
        layernorm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation="silu",
        add_bias_linear=False,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings", False)),
        init_method_std=float(config.get("initializer_range", 0.02)),
        architecture=model_type,
    )


def gqa_kwargs(config: Config, model_type: str, *, uses_window_flag: bool = False) -> dict:
    """:func:`decoder_kwargs` plus grouped-query attention and standard RoPE."""
    heads = int(require(config, "num_attention_heads"))
    head_dim = config.get("head_dim") or None
    return dict(
        decoder_kwargs(config, model_type),
        num_query_groups=int(config.get("num_key_value_heads") or heads),
        kv_channels=int(head_dim) if head_dim else None,
        max_position_embeddings=max_length(config, model_type, uses_window_flag=uses_window_flag),
        **standard_rope(config),
    )


def num_experts(config: Config, *keys: str) -> int:
    """The routed-expert count under the first of ``keys`` present."""
    for key in keys:
        if config.get(key):
            return int(config[key])
    raise CheckpointError(f"config.json: required field {keys[0]!r} is missing")

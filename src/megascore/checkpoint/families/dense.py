"""Dense HF families: ``llama``, ``mistral``, ``qwen2``, ``qwen3`` (torch-free).

All map onto Megatron-Core's GPT model with RMSNorm, SwiGLU, non-interleaved RoPE
(HF's ``rotate_half``) and grouped-query attention:

* qwen2 adds a bias on the fused QKV projection only (``add_qkv_bias``);
* qwen3 has no QKV bias and a per-head RMSNorm on queries and keys before RoPE
  (``q_norm`` / ``k_norm``: Megatron's ``qk_layernorm``);
* Llama-3.x RoPE scaling is accepted with Megatron's hard-coded parameters;
* sliding windows cap the served length at the window (see ``common.max_length``).
"""

from __future__ import annotations

from typing import Any

from megascore.checkpoint.families.common import Config, gqa_kwargs, refuse_if


def _no_biases(config: Config, model_type: str) -> None:
    refuse_if(
        bool(config.get("attention_bias")),
        f"attention_bias=true is not supported for {model_type} (Megatron-Core has no bias "
        "on the output projection alone)",
    )


def llama(config: Config) -> dict[str, Any]:
    _no_biases(config, "llama")
    return gqa_kwargs(config, "llama")


def mistral(config: Config) -> dict[str, Any]:
    _no_biases(config, "mistral")
    return gqa_kwargs(config, "mistral")


def qwen2(config: Config) -> dict[str, Any]:
    return dict(gqa_kwargs(config, "qwen2", uses_window_flag=True), add_qkv_bias=True)


def qwen3_attention(config: Config, model_type: str) -> dict[str, Any]:
    """Qwen3 attention (shared with qwen3_moe): GQA, QK-norm, no biases."""
    _no_biases(config, model_type)
    refuse_if(
        any(t != "full_attention" for t in config.get("layer_types") or ()),
        f"{model_type}: layer_types other than full_attention are not supported",
    )
    return dict(gqa_kwargs(config, model_type, uses_window_flag=True), qk_layernorm=True)


def qwen3(config: Config) -> dict[str, Any]:
    return qwen3_attention(config, "qwen3")

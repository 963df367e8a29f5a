"""Per-family translations of Hugging Face ``config.json`` into ModelConfig fields.

:data:`TRANSLATORS` maps a HF ``model_type`` to a function ``config -> kwargs`` of
:class:`~megascore.model.config.ModelConfig`; :data:`ARCHITECTURES` maps the
``architectures`` class names to model types (for configs without ``model_type``).
Weight names are mapped in ``megascore.checkpoint.hf_weights``.
"""

from __future__ import annotations

from megascore.checkpoint.families.deepseek import deepseek_v3, glm4_moe
from megascore.checkpoint.families.dense import llama, mistral, qwen2, qwen3
from megascore.checkpoint.families.moe import mixtral, qwen3_moe

TRANSLATORS = {
    "llama": llama,
    "mistral": mistral,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "mixtral": mixtral,
    "qwen3_moe": qwen3_moe,
    "deepseek_v3": deepseek_v3,
    "glm4_moe": glm4_moe,
}

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
}

__all__ = ["ARCHITECTURES", "TRANSLATORS"]

"""HF config.json -> ModelConfig translation (pure, no torch)."""

from __future__ import annotations

import pytest

from megascore.api.errors import CheckpointError
from megascore.checkpoint.hf_config import hf_config_to_model_config

# Llama-3.1-8B's config.json (transformers 4.x layout).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}


def test_llama31_maps_every_field():
    cfg = hf_config_to_model_config(LLAMA31_8B)
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (32, 4096, 14336)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (32, 8, 128)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (128256, 131072)
    assert cfg.rotary_base == 500000.0 and cfg.rope_scaling and cfg.rope_scaling_factor == 8.0
    assert cfg.layernorm_epsilon == 1e-5 and cfg.normalization == "RMSNorm"
    assert cfg.gated_linear_unit and cfg.activation == "silu"
    assert not cfg.add_qkv_bias and not cfg.share_embeddings_and_output_weights
    assert cfg.architecture == "llama" and not cfg.is_moe


def test_llama3_rope_with_other_factors_is_rejected():
    config = dict(LLAMA31_8B, rope_scaling=dict(LLAMA31_8B["rope_scaling"], high_freq_factor=2.0))
    with pytest.raises(CheckpointError, match="high_freq_factor"):
        hf_config_to_model_config(config)
    config = dict(LLAMA31_8B, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(CheckpointError, match="rope_type 'yarn'"):
        hf_config_to_model_config(config)


def test_transformers5_rope_parameters_and_head_dim():
    config = {
        "model_type": "mistral",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_hidden_layers": 2,
        "vocab_size": 256,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
    }
    cfg = hf_config_to_model_config(config)
    assert cfg.kv_channels == 32 and cfg.rotary_base == 1e6 and not cfg.rope_scaling
    assert cfg.max_position_embeddings == 4096  # capped at the sliding window


def test_qwen2_bias_tie_and_ignored_window():
    config = {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "num_hidden_layers": 24,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "use_sliding_window": False,
        "rope_theta": 1e6,
        "tie_word_embeddings": True,
    }
    cfg = hf_config_to_model_config(config)
    assert cfg.add_qkv_bias and cfg.share_embeddings_and_output_weights
    assert cfg.max_position_embeddings == 32768 and cfg.kv_channels == 64


def test_mixtral_moe_fields():
    config = {
        "architectures": ["MixtralForCausalLM"],  # no model_type: taken from architectures
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "vocab_size": 32000,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.02,
    }
    cfg = hf_config_to_model_config(config)
    assert cfg.architecture == "mixtral" and cfg.num_moe_experts == 8
    assert cfg.moe_router_topk == 2 and cfg.moe_ffn_hidden_size == 14336
    assert cfg.moe_router_score_function == "softmax" and not cfg.moe_router_pre_softmax
    assert cfg.moe_aux_loss_coeff == 0.02


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"model_type": "gpt2"}, r"'gpt2' is not supported; supported architectures: llama"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_hidden_layers": None}, "'num_hidden_layers' is missing"),
        ({"num_key_value_heads": 5}, "multiple of num_query_groups"),
    ],
)
def test_unsupported_configs_raise(change, needle):
    with pytest.raises(CheckpointError, match=needle):
        hf_config_to_model_config(dict(LLAMA31_8B, **change))

"""config.json -> ModelConfig for qwen3, qwen3_moe, deepseek_v3 and glm4_moe (pure, no torch).

The configs are the published ones of Qwen3-8B, Qwen3-30B-A3B, DeepSeek-V3 and GLM-4.5
(the fields that matter, transformers 4 layout); each distinctive option must land on
the Megatron-Core field that computes it, and each option Megatron-Core would compute
differently must be refused with the field named.
"""

from __future__ import annotations

import pytest

from megascore.api.errors import CheckpointError
from megascore.checkpoint.hf_config import hf_config_to_model_config

QWEN3_8B = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 36,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-06,
    "attention_bias": False,
    "sliding_window": None,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
}
QWEN3_30B_A3B = dict(
    QWEN3_8B,
    model_type="qwen3_moe",
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    router_aux_loss_coef=0.001,
)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rms_norm_eps": 1e-06,
    "vocab_size": 129280,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
}
GLM45 = {
    "model_type": "glm4_moe",
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 92,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "partial_rotary_factor": 0.5,
    "attention_bias": True,
    "use_qk_norm": True,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 131072,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-05,
    "vocab_size": 151552,
    "tie_word_embeddings": False,
}


def test_qwen3_qk_norm_no_bias():
    cfg = hf_config_to_model_config(QWEN3_8B)
    assert cfg.architecture == "qwen3" and cfg.qk_layernorm and not cfg.add_qkv_bias
    assert (cfg.kv_channels, cfg.num_query_groups, cfg.rotary_base) == (128, 8, 1e6)
    assert cfg.max_position_embeddings == 40960 and not cfg.is_moe


def test_qwen3_moe_routing_and_dense_layers():
    cfg = hf_config_to_model_config(QWEN3_30B_A3B)
    assert cfg.qk_layernorm and cfg.num_moe_experts == 128 and cfg.moe_router_topk == 8
    assert cfg.moe_ffn_hidden_size == 768 and cfg.ffn_hidden_size == 6144
    assert cfg.moe_router_score_function == "softmax"
    assert not cfg.moe_router_pre_softmax  # norm_topk_prob: softmax over the top-k logits
    assert cfg.moe_layer_freq == 1 and cfg.moe_aux_loss_coeff == 0.001
    cfg = hf_config_to_model_config(
        dict(QWEN3_30B_A3B, norm_topk_prob=False, mlp_only_layers=[0, 5], decoder_sparse_step=2)
    )
    assert cfg.moe_router_pre_softmax
    want = [int(i not in (0, 5) and (i + 1) % 2 == 0) for i in range(48)]
    assert cfg.moe_layer_freq == want and want[1] == 1 and want[5] == 0 and want[2] == 0


def test_deepseek_v3_mla_yarn_router_mtp():
    cfg = hf_config_to_model_config(DEEPSEEK_V3)
    assert cfg.multi_latent_attention and cfg.qk_layernorm
    assert (cfg.q_lora_rank, cfg.kv_lora_rank) == (1536, 512)
    assert (cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == (128, 64, 128)
    assert cfg.rope_type == "yarn" and cfg.rotary_scaling_factor == 40
    assert cfg.original_max_position_embeddings == 4096
    assert (cfg.mscale, cfg.mscale_all_dim, cfg.beta_fast, cfg.beta_slow) == (1.0, 1.0, 32, 1)
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_enable_expert_bias
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (8, 4)
    assert cfg.moe_router_topk_scaling_factor == 2.5
    assert cfg.moe_layer_freq == [0, 0, 0] + [1] * 58
    assert cfg.moe_shared_expert_intermediate_size == 2048 and cfg.ffn_hidden_size == 18432
    assert cfg.mtp_num_layers == 1 and cfg.moe_router_load_balancing_type == "seq_aux_loss"
    cfg = hf_config_to_model_config(dict(DEEPSEEK_V3, q_lora_rank=None, rope_scaling=None))
    assert cfg.q_lora_rank is None and cfg.rope_type == "rope"


def test_glm45_partial_rotary_bias_qk_norm_router():
    cfg = hf_config_to_model_config(GLM45)
    assert cfg.rotary_percent == 0.5 and cfg.add_qkv_bias and cfg.qk_layernorm
    assert cfg.kv_channels == 128 and cfg.num_query_groups == 8
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_enable_expert_bias
    assert cfg.moe_router_num_groups is None and cfg.moe_router_topk_scaling_factor == 2.5
    assert cfg.moe_layer_freq == [0, 0, 0] + [1] * 89 and cfg.mtp_num_layers == 1
    assert not cfg.multi_latent_attention


@pytest.mark.parametrize(
    ("base", "change", "needle"),
    [
        (QWEN3_8B, {"attention_bias": True}, "attention_bias=true"),
        (QWEN3_8B, {"layer_types": ["sliding_attention"] * 36}, "layer_types"),
        (QWEN3_8B, {"rope_scaling": {"rope_type": "yarn", "factor": 4}}, "rope_type 'yarn'"),
        (QWEN3_30B_A3B, {"mlp_only_layers": list(range(48))}, "no layer is a MoE layer"),
        (QWEN3_30B_A3B, {"shared_expert_intermediate_size": 64}, "shared_expert"),
        (DEEPSEEK_V3, {"topk_group": 2}, "num_experts_per_tok / topk_group == 2"),
        (DEEPSEEK_V3, {"scoring_func": "softmax"}, "scoring_func 'softmax'"),
        (DEEPSEEK_V3, {"topk_method": "greedy"}, "topk_method 'greedy'"),
        (DEEPSEEK_V3, {"norm_topk_prob": False}, "norm_topk_prob=false"),
        (DEEPSEEK_V3, {"rope_interleave": False}, "rope_interleave=false"),
        (DEEPSEEK_V3, {"num_key_value_heads": 16}, "num_key_value_heads"),
        (DEEPSEEK_V3, {"moe_layer_freq": 2}, "moe_layer_freq"),
        (DEEPSEEK_V3, {"rope_scaling": {"type": "linear", "factor": 2}}, "rope_type 'linear'"),
        (GLM45, {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        (GLM45, {"n_group": 3}, "n_group 3 must divide"),
    ],
)
def test_unsupported_options_are_refused(base, change, needle):
    with pytest.raises(CheckpointError, match=needle):
        hf_config_to_model_config(dict(base, **change))

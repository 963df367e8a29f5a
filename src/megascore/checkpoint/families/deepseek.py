"""Sigmoid-router MoE HF families with MTP layers: ``deepseek_v3``, ``glm4_moe`` (torch-free).

Both route with a sigmoid score per expert; the top-k choice adds the learned
``e_score_correction_bias`` (Megatron ``moe_router_enable_expert_bias``) and may be
group-limited (``n_group`` / ``topk_group``: Megatron ``moe_router_num_groups`` /
``moe_router_group_topk``); the chosen scores are renormalised and multiplied by
``routed_scaling_factor`` (``moe_router_topk_scaling_factor``). The first
``first_k_dense_replace`` layers keep a dense MLP of ``intermediate_size``
(``moe_layer_freq`` list); every MoE layer adds ``n_shared_experts`` always-on
experts (``moe_shared_expert_intermediate_size``). ``num_nextn_predict_layers`` MTP
layers follow the decoder in the checkpoint (Megatron ``mtp_num_layers``).

* deepseek_v3: multi-latent attention (Megatron ``MLATransformerConfig``): optional
  query down-projection (``q_lora_rank``; None projects queries in one step), the
  key/value latent (``kv_lora_rank``) shared by all heads, per-head no-RoPE and RoPE
  query/key dims (``qk_nope_head_dim`` / ``qk_rope_head_dim``), ``v_head_dim``;
  default or YaRN RoPE on the interleaved RoPE dims.
* glm4_moe: grouped-query attention with RoPE on the first ``partial_rotary_factor``
  of each head, optional QKV bias (``attention_bias``) and QK-norm (``use_qk_norm``).

Load balancing is reported as Megatron-Bridge configures these models for training:
the sequence-level aux loss with coefficient 1e-4 (the checkpoints' configs carry none).
The router computes in fp32, as Megatron-Bridge's DeepSeek and GLM-MoE providers set
``moe_router_dtype="fp32"`` (bf16 scores would flip near-tied routes and the logprobs
would drift from the trainer's); ``--moe-router-dtype`` overrides it.
"""

from __future__ import annotations

from typing import Any

from megascore.checkpoint.families.common import (
    Config,
    decoder_kwargs,
    gqa_kwargs,
    num_experts,
    refuse_if,
    require,
    rope_parameters,
)

SEQ_AUX_LOSS_COEFF = 1e-4
"""Megatron-Bridge's ``moe_aux_loss_coeff`` for DeepSeek-V3 / GLM-4.5 (``seq_aux_loss``)."""

_YARN_KEYS = {
    "factor": "rotary_scaling_factor",
    "original_max_position_embeddings": "original_max_position_embeddings",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
}


def sigmoid_router_kwargs(config: Config, model_type: str, num_layers: int) -> dict[str, Any]:
    """MoE fields of the DeepSeek-V3-style router, dense-first layers and shared experts."""
    experts = num_experts(config, "n_routed_experts", "num_local_experts")
    topk = int(require(config, "num_experts_per_tok"))
    refuse_if(
        config.get("scoring_func", "sigmoid") != "sigmoid",
        f"{model_type}: scoring_func {config.get('scoring_func')!r} is not supported (sigmoid)",
    )
    refuse_if(
        config.get("topk_method", "noaux_tc") != "noaux_tc",
        f"{model_type}: topk_method {config.get('topk_method')!r} is not supported (noaux_tc)",
    )
    refuse_if(
        not config.get("norm_topk_prob", True) and topk > 1,
        f"{model_type}: norm_topk_prob=false is not supported (Megatron-Core renormalises "
        "sigmoid top-k scores)",
    )
    refuse_if(
        int(config.get("moe_layer_freq") or 1) != 1,
        f"{model_type}: moe_layer_freq other than 1 is not supported",
    )
    groups = int(config.get("n_group") or 1)
    group_topk = int(config.get("topk_group") or 1)
    if groups > 1:
        refuse_if(experts % groups, f"{model_type}: n_group {groups} must divide the experts")
        # HF ranks a group by the sum of its top-2 scores; Megatron by its top-(k / topk_group)
        refuse_if(
            topk % group_topk or topk // group_topk != 2,
            f"{model_type}: group-limited routing needs num_experts_per_tok / topk_group == 2 "
            f"(got {topk} / {group_topk}); Megatron-Core ranks groups by their top "
            "(num_experts_per_tok / topk_group) scores, transformers by their top 2",
        )
    first_dense = int(config.get("first_k_dense_replace") or 0)
    refuse_if(first_dense >= num_layers, f"{model_type}: first_k_dense_replace covers all layers")
    moe_ffn = int(require(config, "moe_intermediate_size"))
    shared = int(config.get("n_shared_experts") or 0)
    mtp = int(config.get("num_nextn_predict_layers") or 0)
    return dict(
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=moe_ffn,
        moe_router_score_function="sigmoid",
        moe_router_pre_softmax=True,
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=group_topk if groups > 1 else None,
        moe_router_topk_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=SEQ_AUX_LOSS_COEFF,
        moe_shared_expert_intermediate_size=shared * moe_ffn or None,
        moe_layer_freq=[0] * first_dense + [1] * (num_layers - first_dense) if first_dense else 1,
        mtp_num_layers=mtp or None,
    )


def _mla_rope(config: Config) -> dict[str, Any]:
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    refuse_if(
        not config.get("rope_interleave", True),
        "deepseek_v3: rope_interleave=false is not supported (Megatron-Core's MLA de-interleaves "
        "the RoPE dims as DeepSeek's weights are laid out)",
    )
    out: dict[str, Any] = {"rotary_base": float(params["rope_theta"])}
    if rope_type == "default":
        return out
    refuse_if(
        rope_type != "yarn",
        f"deepseek_v3: rope_type {rope_type!r} is not supported (only default and yarn)",
    )
    refuse_if(
        params.get("truncate") is False,
        "deepseek_v3: yarn truncate=false is not supported",
    )
    out["rope_type"] = "yarn"
    out["rotary_scaling_factor"] = float(require(params, "factor"))
    for hf_key, field in _YARN_KEYS.items():
        if params.get(hf_key) is not None and hf_key != "factor":
            out[field] = params[hf_key]
    out.setdefault(
        "original_max_position_embeddings", int(require(config, "max_position_embeddings"))
    )
    return out


def deepseek_v3(config: Config) -> dict[str, Any]:
    refuse_if(
        bool(config.get("attention_bias")), "deepseek_v3: attention_bias=true is not supported"
    )
    kwargs = decoder_kwargs(config, "deepseek_v3")
    heads = kwargs["num_attention_heads"]
    kv_heads = int(config.get("num_key_value_heads") or heads)
    refuse_if(kv_heads != heads, "deepseek_v3: num_key_value_heads must equal num_attention_heads")
    q_lora = config.get("q_lora_rank")
    return dict(
        kwargs,
        num_query_groups=heads,
        max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
        multi_latent_attention=True,
        qk_layernorm=True,  # MLA's q_a_layernorm / kv_a_layernorm
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(require(config, "kv_lora_rank")),
        qk_head_dim=int(require(config, "qk_nope_head_dim")),
        qk_pos_emb_head_dim=int(require(config, "qk_rope_head_dim")),
        v_head_dim=int(require(config, "v_head_dim")),
        **_mla_rope(config),
        **sigmoid_router_kwargs(config, "deepseek_v3", kwargs["num_layers"]),
    )


def glm4_moe(config: Config) -> dict[str, Any]:
    kwargs = gqa_kwargs(config, "glm4_moe")
    if "rotary_percent" not in kwargs:
        kwargs["rotary_percent"] = 0.5  # transformers' Glm4MoeConfig default
    return dict(
        kwargs,
        add_qkv_bias=bool(config.get("attention_bias", False)),
        qk_layernorm=bool(config.get("use_qk_norm", False)),
        **sigmoid_router_kwargs(config, "glm4_moe", kwargs["num_layers"]),
    )

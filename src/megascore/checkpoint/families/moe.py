"""Softmax-router MoE HF families: ``mixtral``, ``qwen3_moe`` (torch-free).

* mixtral: ``num_local_experts`` SwiGLU experts in every layer, top-k on the router
  logits then softmax over the k (HF renormalises the top-k softmax probabilities,
  which is what Megatron computes with ``moe_router_pre_softmax=False``).
* qwen3_moe: qwen3 attention (QK-norm); ``norm_topk_prob`` true is mixtral's routing,
  false is softmax over all experts then the top-k probabilities as they are
  (``moe_router_pre_softmax=True``). Layers listed in ``mlp_only_layers``, and those
  off the ``decoder_sparse_step`` rhythm, keep a dense MLP of ``intermediate_size``
  (Megatron's per-layer ``moe_layer_freq`` list).
"""

from __future__ import annotations

from typing import Any

from megascore.checkpoint.families.common import (
    Config,
    gqa_kwargs,
    num_experts,
    refuse_if,
    require,
)
from megascore.checkpoint.families.dense import qwen3_attention


def mixtral(config: Config) -> dict[str, Any]:
    refuse_if(bool(config.get("attention_bias")), "attention_bias=true is not supported")
    return dict(
        gqa_kwargs(config, "mixtral"),
        num_moe_experts=num_experts(config, "num_local_experts"),
        moe_router_topk=int(config.get("num_experts_per_tok", 2)),
        moe_ffn_hidden_size=int(require(config, "intermediate_size")),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0) or 0.0),
    )


def qwen3_moe_layers(config: Config, num_layers: int) -> list[int]:
    """1 for a MoE layer, 0 for a dense one (transformers' ``Qwen3MoeDecoderLayer`` rule)."""
    dense = set(config.get("mlp_only_layers") or ())
    step = int(config.get("decoder_sparse_step") or 1)
    return [int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)]


def qwen3_moe(config: Config) -> dict[str, Any]:
    refuse_if(
        bool(config.get("shared_expert_intermediate_size")),
        "qwen3_moe: shared_expert_intermediate_size is not supported (Qwen3-MoE has none)",
    )
    kwargs = qwen3_attention(config, "qwen3_moe")
    layers = qwen3_moe_layers(config, kwargs["num_layers"])
    refuse_if(not any(layers), "qwen3_moe: no layer is a MoE layer (mlp_only_layers covers all)")
    return dict(
        kwargs,
        num_moe_experts=num_experts(config, "num_experts", "num_local_experts"),
        moe_router_topk=int(require(config, "num_experts_per_tok")),
        moe_ffn_hidden_size=int(require(config, "moe_intermediate_size")),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not config.get("norm_topk_prob", False),
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0) or 0.0),
        moe_layer_freq=layers if not all(layers) else 1,
    )

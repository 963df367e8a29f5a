"""Multi-latent attention on the "torch" backend: Megatron-Core's ``MLASelfAttention``.

The local (non-TransformerEngine) layer spec of Megatron-Core 0.19 builds MLA with
``qk_layernorm`` as standalone norms: ``q_layernorm`` after the query down-projection
and ``kv_layernorm`` after the key/value down-projection (DeepSeek-V3's
``q_a_layernorm`` / ``kv_a_layernorm``). Without a query down-projection
(``q_lora_rank`` None, as in DeepSeek-V2-Lite) the queries have no norm, but 0.19's
``QKNormConfigResolver`` then demands a fused norm+linear query projection, which only
TransformerEngine provides; :class:`LocalMLASelfAttention` resolves that one case to
the plain column-parallel projection of the spec. Everything else is Megatron's module.
"""

from __future__ import annotations

import dataclasses

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec


class LocalMLASelfAttention(MLASelfAttention):
    """``MLASelfAttention`` whose query projection without LoRA is the spec's linear layer."""

    def _resolve_qk_norm_config(self, submodules):
        if self.config.q_lora_rank is not None or not self.config.qk_layernorm:
            return super()._resolve_qk_norm_config(submodules)
        return dict(
            linear_q_proj=submodules.linear_q_proj,
            linear_q_up_proj=IdentityOp,
            linear_kv_up_proj=submodules.linear_kv_up_proj,
            q_layernorm=IdentityOp,
            kv_layernorm=submodules.kv_layernorm,
        )


def local_mla_layer_spec(layer_spec: ModuleSpec) -> ModuleSpec:
    """Copy of a local TransformerLayer spec with :class:`LocalMLASelfAttention` (no-op for
    layers whose self-attention is not MLA)."""
    attn = layer_spec.submodules.self_attention
    if attn.module is not MLASelfAttention:
        return layer_spec
    attn = dataclasses.replace(attn, module=LocalMLASelfAttention)
    return dataclasses.replace(
        layer_spec,
        submodules=dataclasses.replace(layer_spec.submodules, self_attention=attn),
    )

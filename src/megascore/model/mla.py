"""Multi-latent attention: Megatron-Core's ``MLASelfAttention``, on either backend.

Megatron-Core 0.19 resolves MLA's q / kv norms (``qk_layernorm``: DeepSeek-V3's
``q_a_layernorm`` / ``kv_a_layernorm``) in ``QKNormConfigResolver``
(``megatron/core/transformer/mla_qk_norm_config.py``). With a query down-projection
(``q_lora_rank`` set) the norms follow the layer spec: standalone ``q_layernorm`` /
``kv_layernorm`` on the local spec, fused into ``linear_q_up_proj`` /
``linear_kv_up_proj`` (``TELayerNormColumnParallelLinear``) on TransformerEngine's.
Without one (``q_lora_rank`` None: DeepSeek-V2-Lite, Moonlight) the queries have no norm,
but ``_resolve_mla_qk_layernorm`` still asks for a fused norm+linear ``linear_q_proj``,
whatever the spec says (both specs say a plain column-parallel linear):

* local spec: it has no fused layer (and its ``q_layernorm`` is refused as unused), so
  the model cannot be built;
* TE spec: ``linear_q_proj`` becomes ``TELayerNormColumnParallelLinear``, a norm before
  the query projection that the checkpoint has no weight for
  (``linear_q_proj.layer_norm_weight``) and that transformers does not compute.

:class:`PlainQueryMLASelfAttention` resolves that one case to the spec's own modules: the
plain ``linear_q_proj``, and the kv norm where the spec keeps it (local:
``kv_layernorm``; TE: fused in ``linear_kv_up_proj``). Everything else is Megatron's
module.
"""

from __future__ import annotations

import dataclasses

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec


class PlainQueryMLASelfAttention(MLASelfAttention):
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


def mla_layer_spec(layer_spec: ModuleSpec) -> ModuleSpec:
    """Copy of a TransformerLayer spec (local or TE) with :class:`PlainQueryMLASelfAttention`
    (no-op for layers whose self-attention is not MLA)."""
    attn = layer_spec.submodules.self_attention
    if attn.module is not MLASelfAttention:
        return layer_spec
    attn = dataclasses.replace(attn, module=PlainQueryMLASelfAttention)
    return dataclasses.replace(
        layer_spec,
        submodules=dataclasses.replace(layer_spec.submodules, self_attention=attn),
    )

"""A CPU stand-in for Megatron-Core's TransformerEngine layer spec, with TE's parameter
names (TransformerEngine cannot be built here).

Derived from ``megatron/core/models/gpt/gpt_layer_specs.py`` of Megatron-Core 0.19,
``get_gpt_layer_with_transformer_engine_submodules`` (what ``get_gpt_decoder_layer_specs``
builds with ``use_transformer_engine=True`` and no down-projection fusion):

* GQA attention: ``input_layernorm`` is not a module (``TransformerLayerSubmodules``
  default ``IdentityOp``); ``linear_qkv`` is ``TELayerNormColumnParallelLinear`` (the
  input norm fused: ``linear_qkv.layer_norm_weight``);
* MLA attention: ``input_layernorm`` stays a norm (``TENorm``); ``linear_q_proj`` is
  ``TEColumnParallelLinear``, with ``qk_layernorm`` ``linear_q_up_proj`` /
  ``linear_kv_up_proj`` are ``TELayerNormColumnParallelLinear`` and ``q_layernorm`` /
  ``kv_layernorm`` ``IdentityOp``. The module resolves them through Megatron's own
  ``QKNormConfigResolver`` (``mla_qk_norm_config.py``), here with :class:`LNColumnParallel`
  as TE's fused layer, so megascore's :class:`PlainQueryMLASelfAttention` (``q_lora_rank``
  None) is checked against what Megatron would build around it;
* ``pre_mlp_layernorm`` is a norm only in MoE layers (``backend.layer_norm() if
  num_experts else IdentityOp``); a dense MLP's ``linear_fc1`` is the fused
  ``TELayerNormColumnParallelLinear`` (``get_mlp_module_spec_for_backend``:
  ``backend.fuse_layernorm_and_linear()``); no keys map renames these.

``TELayerNormColumnParallelLinear`` holds ``weight``, ``layer_norm_weight`` (and
``layer_norm_bias`` for LayerNorm) and checkpoints them like ``ColumnParallelLinear``
(``weight`` / ``bias`` split on axis 0, the norm replicated): :class:`LNColumnParallel`
has those parameters and computes the norm, then the projection. Everything else
(experts, router, shared experts, MTP) has the same names on both backends.
"""

from __future__ import annotations

import dataclasses
import functools
from unittest import mock

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver
from megatron.core.transformer.mlp import MLPSubmodules

from megascore.model.build import make_layer_specs, make_transformer_config
from megascore.model.mla import PlainQueryMLASelfAttention


class LNColumnParallel(ColumnParallelLinear):
    """``TELayerNormColumnParallelLinear``'s parameters on ``ColumnParallelLinear``."""

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.rms = config.normalization == "RMSNorm"
        self.eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(
            torch.ones(input_size, dtype=config.params_dtype)
        )
        if not self.rms:
            self.layer_norm_bias = torch.nn.Parameter(
                torch.zeros(input_size, dtype=config.params_dtype)
            )

    def forward(self, x, *args, **kwargs):
        shape = (x.shape[-1],)
        if self.rms:
            x = F.rms_norm(x, shape, self.layer_norm_weight, self.eps)
        else:
            x = F.layer_norm(x, shape, self.layer_norm_weight, self.layer_norm_bias, self.eps)
        return super().forward(x, *args, **kwargs)


class TEResolver(QKNormConfigResolver):
    """Megatron's MLA norm resolver with TE's layers: :class:`LNColumnParallel` as the
    fused norm+linear (``TELayerNormColumnParallelLinear``)."""

    def __init__(self, config, submodules):
        super().__init__(config, submodules)
        self.linear_impl = ColumnParallelLinear
        self.fused_norm_linear_impl = LNColumnParallel


def _replace(obj, **changes):
    return dataclasses.replace(obj, **changes)


def _te_layer(spec):
    sub = spec.submodules
    attn = sub.self_attention
    moe = not isinstance(sub.mlp.keywords["submodules"], MLPSubmodules)
    if attn.module is PlainQueryMLASelfAttention:
        if attn.submodules.kv_layernorm is not IdentityOp:  # qk_layernorm: TE fuses the norms
            fused = dict(linear_q_up_proj=LNColumnParallel, linear_kv_up_proj=LNColumnParallel)
            norms = dict(q_layernorm=IdentityOp, kv_layernorm=IdentityOp)
            mla = _replace(attn.submodules, **fused, **norms)
            attn = _replace(attn, submodules=mla)
    else:
        attn = _replace(attn, submodules=_replace(attn.submodules, linear_qkv=LNColumnParallel))
        sub = _replace(sub, input_layernorm=IdentityOp)
    mlp = sub.mlp
    pre_mlp = sub.pre_mlp_layernorm
    if not moe:  # a dense MLP: the norm fused into linear_fc1
        mlp_sub = _replace(mlp.keywords["submodules"], linear_fc1=LNColumnParallel)
        mlp = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": mlp_sub})
        pre_mlp = IdentityOp
    sub = _replace(
        sub,
        self_attention=attn,
        mlp=mlp,
        pre_mlp_layernorm=pre_mlp,
        sharded_state_dict_keys_map={},
    )
    return _replace(spec, submodules=sub)


def _te_specs(block, mtp):
    block = _replace(block, layer_specs=[_te_layer(s) for s in block.layer_specs])
    if mtp is not None:
        layers = []
        for layer in mtp.layer_specs:
            inner = _te_layer(layer.submodules.mtp_model_layer)
            sub = _replace(layer.submodules, mtp_model_layer=inner)
            layers.append(_replace(layer, submodules=sub))
        mtp = _replace(mtp, layer_specs=layers)
    return block, mtp


def cpu_gpt_model(
    model_cfg, engine_cfg, pg_collection, *, te_names=False, pre_process=True, post_process=True
):
    """A CPU GPTModel that reports the TE backend (what megatron-bridge requires): with
    ``te_names`` TE's parameter (and checkpoint) names; ``pre_process`` /
    ``post_process`` as Megatron builds a pipeline stage. Build a model with
    ``build_model`` first (it applies the CPU measures and seeds the generators)."""
    from megatron.core.models.gpt import GPTModel

    config = make_transformer_config(model_cfg, engine_cfg, torch.device("cpu"))
    block, mtp = make_layer_specs(config, "torch")
    resolver = QKNormConfigResolver
    if te_names:
        block, mtp = _te_specs(block, mtp)
        resolver = TEResolver
    with mock.patch.object(multi_latent_attention, "QKNormConfigResolver", resolver):
        model = GPTModel(
            config=config,
            transformer_layer_spec=block,
            vocab_size=model_cfg.vocab_size,
            max_sequence_length=model_cfg.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=model_cfg.share_embeddings_and_output_weights,
            position_embedding_type=model_cfg.position_embedding_type,
            rotary_percent=model_cfg.rotary_percent,
            rotary_base=model_cfg.rotary_base,
            mtp_block_spec=mtp,
            pg_collection=pg_collection,
        )
    model.requires_grad_(False)
    model.eval()
    model.megascore_attention_backend = "te"
    return model


def te_shaped_model(model_cfg, engine_cfg, pg_collection):
    """A CPU GPTModel with TE's parameter (and checkpoint) names."""
    return cpu_gpt_model(model_cfg, engine_cfg, pg_collection, te_names=True)

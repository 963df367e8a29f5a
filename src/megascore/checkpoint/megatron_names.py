"""One set of checkpoint keys for Megatron's local and TransformerEngine layer specs.

The two specs of Megatron-Core 0.19 (``megatron.core.models.gpt.gpt_layer_specs``) hold
the same norms in different modules, so their ``sharded_state_dict()`` keys differ:

* attention input norm, GQA: local ``input_layernorm`` (Megatron's local keys map saves
  it as TE's), TE fused into ``self_attention.linear_qkv.layer_norm_*``;
* attention input norm, MLA: ``input_layernorm`` on both (TE: ``TENorm``);
* pre-MLP norm of a dense layer: local ``pre_mlp_layernorm`` (the GQA keys map saves it
  as TE's, MLA layers have no keys map), TE fused into ``mlp.linear_fc1.layer_norm_*``;
* pre-MLP norm of a MoE layer: ``pre_mlp_layernorm`` on both, but the local GQA keys map
  saves it as ``mlp.linear_fc1.layer_norm_*`` (a MoE layer has no ``mlp.linear_fc1``);
* MLA query / key-value norms: local ``self_attention.q_layernorm`` / ``kv_layernorm``,
  TE fused into ``self_attention.linear_q_up_proj`` / ``linear_kv_up_proj``
  ``.layer_norm_*``.

:func:`te_keys` rewrites a model's sharded keys to the TE ones (identity on a TE model),
so a checkpoint saved by either backend carries TE's keys (also what Megatron-LM writes
when it trains with TE) and loads into either. A layer is told apart by its own keys: MoE
when it has ``mlp.router.weight``, MLA when it has ``self_attention.linear_*_up_proj``.
MLA without a query down-projection (``q_lora_rank`` None) has a plain ``linear_q_proj``
on both backends (``megascore.model.mla``); a checkpoint from a trainer whose TE model
fused a norm into it holds ``linear_q_proj.layer_norm_weight``, which the load refuses.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_LAYER = re.compile(r"^(.*?\.)(self_attention|mlp|input_layernorm|pre_mlp_layernorm)\.(.*)$")
_NORM = re.compile(r"^(weight|bias)$")


def _rename(prefix: str, rest: str, keys: set[str]) -> str | None:
    """The TE key of ``prefix + rest`` (``prefix``: one layer, or all layers when stacked)."""
    moe = f"{prefix}mlp.router.weight" in keys
    module, _, param = rest.rpartition(".")
    if module == "mlp.linear_fc1" and param.startswith("layer_norm_") and moe:
        return f"{prefix}pre_mlp_layernorm.{param.removeprefix('layer_norm_')}"
    if not _NORM.match(param):
        return None
    if module == "pre_mlp_layernorm" and not moe and f"{prefix}mlp.linear_fc1.weight" in keys:
        return f"{prefix}mlp.linear_fc1.layer_norm_{param}"
    fused_into = {
        "input_layernorm": "self_attention.linear_qkv",
        "self_attention.q_layernorm": "self_attention.linear_q_up_proj",
        "self_attention.kv_layernorm": "self_attention.linear_kv_up_proj",
    }.get(module)
    if fused_into is not None and f"{prefix}{fused_into}.weight" in keys:
        return f"{prefix}{fused_into}.layer_norm_{param}"
    return None


def te_keys(keys: Iterable[str]) -> dict[str, str]:
    """The checkpoint keys (local or TE spec) that TE's spec names otherwise.

    Args:
        keys: every sharded key of one model (this rank's stage).

    Returns:
        ``{key: TE key}`` for the keys that change; the others keep their name.
    """
    keys = set(keys)
    out = {}
    for key in keys:
        m = _LAYER.match(key)
        if m is None:
            continue
        new = _rename(m[1], f"{m[2]}.{m[3]}", keys)
        if new is not None and new != key:
            out[key] = new
    return out

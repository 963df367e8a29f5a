"""HF safetensors -> Megatron-Core GPTModel parameters, sharded for this rank.

For every entry of the model's ``state_dict`` a *recipe* says which HF tensors
it comes from and how this rank's shard is cut out of them:

* ``linear_qkv`` is fused per query group: for each of the rank's groups the
  group's query heads, then its key head, then its value head
  (``[ng/tp, (nh/ng + 2) * d, hidden]``). Tensor parallelism splits the groups.
* ``linear_fc1`` of a SwiGLU MLP (and of each expert) is ``[gate; up]`` *per
  rank*: rank r holds rows r of the gate projection, then rows r of the up one.
* Row-parallel weights (``linear_proj``, ``linear_fc2``) split their input dim.
* The embedding and output layer split the vocabulary; rows past the checkpoint
  vocabulary (Megatron vocab padding) are zero.
* Experts: rank e of the expert-parallel group holds experts
  ``[e * E/ep, (e+1) * E/ep)``; inside an expert the expert-TP group splits as above.

Everything is checked from the file headers (names, shapes, sizes) before any
data is read, and the full set of local shards is staged on the host before the
first parameter is overwritten, so a bad checkpoint leaves the model untouched.
(Where megatron-bridge applies, ``megascore.checkpoint.hf_bridge`` loads instead.)
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import torch

from megascore.checkpoint.recipes import (
    QKV,
    GatedFC1,
    ParallelRanks,
    Recipe,
    Replicated,
    Split,
    Src,
    VocabRows,
)
from megascore.checkpoint.resolve import check_every_parameter_written, model_tensor_names
from megascore.checkpoint.safetensors_io import SafetensorsDir
from megascore.errors import CheckpointError
from megascore.model.config import ModelConfig

logger = logging.getLogger(__name__)

_IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_SEQ_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight")
_TE_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)")


@dataclasses.dataclass
class HFLoadPlan:
    """Validated recipes for every parameter of one model on this rank."""

    directory: Path
    recipes: dict[str, Recipe]
    """Megatron state-dict name -> recipe producing this rank's tensor."""
    unused: list[str]
    """HF tensors no recipe reads."""


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def _layer_offset(model: torch.nn.Module) -> int:
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    if layers is None or len(layers) == 0:
        return 0
    return int(getattr(layers[0], "layer_number", 1)) - 1


class _Mapper:
    """Maps Megatron parameter names to recipes over HF tensor names."""

    def __init__(self, cfg: ModelConfig, reader: SafetensorsDir, ranks: ParallelRanks):
        self.cfg, self.reader, self.ranks = cfg, reader, ranks
        self.fused_experts = any(n.endswith("mlp.experts.gate_up_proj") for n in reader.names())

    def __call__(self, name: str, layer_offset: int) -> Recipe:
        cfg, r = self.cfg, self.ranks
        h, v = cfg.hidden_size, cfg.vocab_size
        if name == "embedding.word_embeddings.weight":
            return VocabRows(Src("model.embed_tokens.weight", (v, h)), r.tp_rank, r.tp_size)
        if name == "output_layer.weight":
            # tied embeddings: a last pipeline stage holds its own copy of the embedding
            tied = cfg.share_embeddings_and_output_weights
            head = "model.embed_tokens.weight" if tied else "lm_head.weight"
            return VocabRows(Src(head, (v, h)), r.tp_rank, r.tp_size)
        if name == "decoder.final_layernorm.weight":
            return Replicated(Src("model.norm.weight", (h,)))
        m = _LAYER.fullmatch(name)
        if m:
            recipe = self._layer(int(m.group(1)) + layer_offset, m.group(2))
            if recipe is not None:
                return recipe
        raise CheckpointError(f"no HF source known for Megatron parameter {name!r}")

    def _layer(self, i: int, rest: str) -> Recipe | None:
        cfg, r = self.cfg, self.ranks
        h, d = cfg.hidden_size, cfg.kv_channels
        nh, ng = cfg.num_attention_heads, cfg.num_query_groups
        p = f"model.layers.{i}."
        if rest in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
            return Replicated(Src(p + "input_layernorm.weight", (h,)))
        if rest in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
            return Replicated(Src(p + "post_attention_layernorm.weight", (h,)))
        if rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            tail = (h,) if kind == "weight" else ()
            srcs = [
                Src(f"{p}self_attn.{x}_proj.{kind}", (n * d, *tail))
                for x, n in (("q", nh), ("k", ng), ("v", ng))
            ]
            return QKV(*srcs, groups=ng, heads=nh, head_dim=d, rank=r.tp_rank, size=r.tp_size)
        if rest == "self_attention.linear_proj.weight":
            return Split(Src(p + "self_attn.o_proj.weight", (h, nh * d)), 1, r.tp_rank, r.tp_size)
        if rest in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
            qk = rest.split(".")[1][0]  # "q" or "k"
            return Replicated(Src(f"{p}self_attn.{qk}_norm.weight", (d,)))
        f = cfg.ffn_hidden_size
        if rest == "mlp.linear_fc1.weight":
            gate = Src(p + "mlp.gate_proj.weight", (f, h))
            up = Src(p + "mlp.up_proj.weight", (f, h))
            return GatedFC1(gate, up, r.tp_rank, r.tp_size)
        if rest == "mlp.linear_fc2.weight":
            return Split(Src(p + "mlp.down_proj.weight", (h, f)), 1, r.tp_rank, r.tp_size)
        if rest == "mlp.router.weight":
            router = "mlp.gate.weight" if self.fused_experts else "block_sparse_moe.gate.weight"
            router = p + router
            return Replicated(Src(router, (cfg.num_moe_experts, h)))
        m = _SEQ_EXPERT.fullmatch(rest)
        if m:
            return self._expert(p, int(m.group(1)), m.group(2))
        m = _TE_EXPERT.fullmatch(rest)
        if m:
            return self._expert(p, int(m.group(2)), m.group(1))
        return None

    def _expert(self, p: str, local: int, which: str) -> Recipe:
        cfg, r = self.cfg, self.ranks
        num = cfg.num_moe_experts or 0
        if num % r.ep_size:
            raise CheckpointError(f"{num} experts do not split over expert parallel {r.ep_size}")
        e = r.ep_rank * (num // r.ep_size) + local
        h, f = cfg.hidden_size, cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
        if self.fused_experts:  # transformers >= 5 layout: [E, 2F, H] and [E, H, F]
            if which == "linear_fc1":
                name = p + "mlp.experts.gate_up_proj"
                gate = Src(name, (f, h), lead=(e,), row0=0, full=(num, 2 * f, h))
                up = Src(name, (f, h), lead=(e,), row0=f, full=(num, 2 * f, h))
                return GatedFC1(gate, up, r.etp_rank, r.etp_size)
            src = Src(p + "mlp.experts.down_proj", (h, f), lead=(e,), full=(num, h, f))
            return Split(src, 1, r.etp_rank, r.etp_size)
        q = f"{p}block_sparse_moe.experts.{e}."
        if which == "linear_fc1":
            gate, up = Src(q + "w1.weight", (f, h)), Src(q + "w3.weight", (f, h))
            return GatedFC1(gate, up, r.etp_rank, r.etp_size)
        return Split(Src(q + "w2.weight", (h, f)), 1, r.etp_rank, r.etp_size)


def plan_hf_load(
    model: torch.nn.Module, model_cfg: ModelConfig, reader: SafetensorsDir
) -> HFLoadPlan:
    """Builds and validates the recipes for every parameter of ``model`` on this rank.

    Reads only file headers. Checks that each HF tensor exists with the shape the
    architecture implies and that each local shard matches the model's parameter.

    Args:
        model: the built GPTModel (possibly wrapped) on this rank.
        model_cfg: its architecture (the checkpoint's ``config.json`` translation).
        reader: the checkpoint's safetensors files.

    Returns:
        The validated plan.

    Raises:
        CheckpointError: missing tensor, wrong shape, vocabulary mismatch, or a
            model parameter without a known HF source.
    """
    model = _unwrap(model)
    ranks = ParallelRanks.from_model(model)
    embed = "model.embed_tokens.weight"
    if embed in reader and reader.shape(embed)[0] != model_cfg.vocab_size:
        raise CheckpointError(
            f"vocab mismatch: {embed} has {reader.shape(embed)[0]} rows but the model "
            f"vocab_size is {model_cfg.vocab_size}"
        )
    mapper = _Mapper(model_cfg, reader, ranks)
    offset = _layer_offset(model)
    recipes: dict[str, Recipe] = {}
    used: set[str] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state"):
            continue
        recipe = mapper(name, offset)
        recipe.fit(tuple(tensor.shape))
        recipe.validate(reader, name)
        if tuple(tensor.shape) != recipe.local_shape():
            raise CheckpointError(
                f"Megatron parameter {name!r} has shape {tuple(tensor.shape)} on this rank but "
                f"the checkpoint ({', '.join(recipe.sources())}) gives {recipe.local_shape()}"
            )
        recipes[name] = recipe
        used.update(recipe.sources())
    unused = [n for n in reader.names() if n not in used and not _IGNORED_HF.match(n)]
    if model_cfg.share_embeddings_and_output_weights:
        unused = [n for n in unused if n != "lm_head.weight"]
    if unused:
        logger.warning(
            "%s: %d HF tensors unused, e.g. %s", reader.directory, len(unused), unused[:5]
        )
    return HFLoadPlan(reader.directory, recipes, unused)


def stage_hf_weights(
    plan: HFLoadPlan, reader: SafetensorsDir, model: torch.nn.Module
) -> dict[str, torch.Tensor]:
    """Reads this rank's shards into host tensors in the parameters' dtypes."""
    targets = _unwrap(model).state_dict(keep_vars=True)
    staged = {}
    for name, recipe in plan.recipes.items():
        staged[name] = recipe.read(reader).to(targets[name].dtype)
    return staged


def copy_into_model(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copies staged tensors into the model's parameters/buffers (same names, same shapes)."""
    targets = _unwrap(model).state_dict(keep_vars=True)
    with torch.no_grad():
        for name, value in tensors.items():
            targets[name].copy_(value, non_blocking=False)


def load_hf_weights(model: torch.nn.Module, model_cfg: ModelConfig, directory: str | Path) -> None:
    """Validates, then loads a HF safetensors checkpoint into ``model`` on this rank.

    Args:
        model: the built (possibly wrapped) GPTModel of this rank.
        model_cfg: the architecture the model was built from.
        directory: HF checkpoint directory (``config.json`` + safetensors).

    Raises:
        CheckpointError: the checkpoint does not fit the model, or a parameter has no
            recipe. Found before any parameter is written: the model is then unchanged.
    """
    directory = Path(directory)
    with SafetensorsDir(directory) as reader:
        plan = plan_hf_load(model, model_cfg, reader)
        expected = model_tensor_names(_unwrap(model))
        check_every_parameter_written(expected, plan.recipes, str(directory))
        staged = stage_hf_weights(plan, reader, model)
    copy_into_model(model, staged)
    logger.info("loaded %d tensors from %s", len(staged), directory)

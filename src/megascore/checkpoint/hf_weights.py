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
When megatron-bridge is importable (``HAVE_BRIDGE``; GPU images) its
``AutoBridge`` performs the copy instead (:func:`_load_with_bridge`), after the
same validation; ``MEGASCORE_HF_LOADER=native`` keeps megascore's reader.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path

import torch

from megascore.checkpoint.recipes import (
    QKV,
    GatedFC1,
    ParallelRanks,
    Recipe,
    Replicated,
    RowsOrReplicated,
    Split,
    Src,
    VocabRows,
)
from megascore.checkpoint.safetensors_io import SafetensorsDir
from megascore.errors import CheckpointError
from megascore.model.config import ModelConfig

logger = logging.getLogger(__name__)

_IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_MTP = re.compile(r"mtp\.layers\.(\d+)\.(.+)")
_MTP_OWN = {  # MTP layer parts -> HF names under model.layers.{num_layers + i}.
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}
_MTP_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": ""}
"""HF copies in each MTP layer of tensors Megatron shares with the main model ("": the
output layer, ``lm_head.weight`` or the tied embedding)."""
_SEQ_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight")
_TE_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)")


try:  # the GPU path: megatron-bridge imports transformer_engine, which needs CUDA
    from megatron.bridge import AutoBridge

    HAVE_BRIDGE = True
except Exception:  # noqa: BLE001 - ImportError, or TE failing to find CUDA libraries
    AutoBridge = None
    HAVE_BRIDGE = False


def use_bridge(model: torch.nn.Module) -> bool:
    """Whether HF weights go through AutoBridge: HAVE_BRIDGE and a TransformerEngine-spec
    model (the parameter names the bridge maps), unless ``MEGASCORE_HF_LOADER=native``."""
    if not HAVE_BRIDGE or os.environ.get("MEGASCORE_HF_LOADER", "auto") == "native":
        return False
    return getattr(_unwrap(model), "megascore_attention_backend", "te") == "te"


@dataclasses.dataclass
class HFLoadPlan:
    """Validated recipes for every parameter of one model on this rank."""

    directory: Path
    recipes: dict[str, Recipe]
    """Megatron state-dict name -> recipe producing this rank's tensor."""
    unused: list[str]
    """HF tensors no recipe reads."""
    copies: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(MTP layer copy, main tensor) pairs that must be equal: Megatron's MTP layers use
    the main model's embedding and output layer."""


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
            return VocabRows(Src("lm_head.weight", (v, h)), r.tp_rank, r.tp_size)
        if name == "decoder.final_layernorm.weight":
            return Replicated(Src("model.norm.weight", (h,)))
        m = _LAYER.fullmatch(name)
        if m:
            recipe = self._layer(int(m.group(1)) + layer_offset, m.group(2))
            if recipe is not None:
                return recipe
        m = _MTP.fullmatch(name)
        if m:
            recipe = self._mtp(cfg.num_layers + int(m.group(1)), m.group(2))
            if recipe is not None:
                return recipe
        raise CheckpointError(f"no HF source known for Megatron parameter {name!r}")

    def _mtp(self, i: int, rest: str) -> Recipe | None:
        """MTP layer parts (HF layer ``i`` = num_layers + MTP index, DeepSeek-V3 layout)."""
        h, p = self.cfg.hidden_size, f"model.layers.{i}."
        if rest in _MTP_OWN:
            return Replicated(Src(p + _MTP_OWN[rest], (h,)))
        if rest == "eh_proj.weight":  # input: [enorm(embedding); hnorm(hidden)]
            src = Src(p + "eh_proj.weight", (h, 2 * h))
            return Split(src, 0, self.ranks.tp_rank, self.ranks.tp_size)
        if rest.startswith("mtp_model_layer."):
            return self._layer(i, rest[len("mtp_model_layer.") :])
        return None

    def _layer(self, i: int, rest: str) -> Recipe | None:
        cfg, r = self.cfg, self.ranks
        h, d = cfg.hidden_size, cfg.kv_channels
        nh, ng = cfg.num_attention_heads, cfg.num_query_groups
        p = f"model.layers.{i}."
        if rest in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
            return Replicated(Src(p + "input_layernorm.weight", (h,)))
        if rest in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
            return Replicated(Src(p + "post_attention_layernorm.weight", (h,)))
        if cfg.multi_latent_attention and rest.startswith("self_attention."):
            return self._mla(p, rest[len("self_attention.") :])
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
            mixtral = p + "block_sparse_moe.gate.weight"
            router = mixtral if mixtral in self.reader else p + "mlp.gate.weight"
            return Replicated(Src(router, (cfg.num_moe_experts, h)))
        if rest == "mlp.router.expert_bias":
            return Replicated(Src(p + "mlp.gate.e_score_correction_bias", (cfg.num_moe_experts,)))
        if rest.startswith("mlp.shared_experts.linear_fc"):
            fs, q = cfg.moe_shared_expert_intermediate_size, p + "mlp.shared_experts."
            if rest == "mlp.shared_experts.linear_fc1.weight":
                gate, up = Src(q + "gate_proj.weight", (fs, h)), Src(q + "up_proj.weight", (fs, h))
                return GatedFC1(gate, up, r.tp_rank, r.tp_size)
            if rest == "mlp.shared_experts.linear_fc2.weight":
                return Split(Src(q + "down_proj.weight", (h, fs)), 1, r.tp_rank, r.tp_size)
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
        names = ("w1", "w3", "w2")  # mixtral: gate, up, down
        if q + "w1.weight" not in self.reader:  # qwen3_moe / deepseek_v3 / glm4_moe
            q, names = f"{p}mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj")
        if which == "linear_fc1":
            gate, up = Src(f"{q}{names[0]}.weight", (f, h)), Src(f"{q}{names[1]}.weight", (f, h))
            return GatedFC1(gate, up, r.etp_rank, r.etp_size)
        return Split(Src(f"{q}{names[2]}.weight", (h, f)), 1, r.etp_rank, r.etp_size)

    def _mla(self, p: str, rest: str) -> Recipe | None:
        """Multi-latent attention (Megatron local or TE spec names; DeepSeek-V3 HF names).

        Per-head rows (q up-projection: no-RoPE then RoPE dims; kv up-projection: key
        no-RoPE dims then value dims) are laid out head-major on both sides, so TP
        splits whole heads. The RoPE dims stay interleaved: Megatron's MLA
        de-interleaves them as transformers does (``rope_interleave``).
        """
        cfg, r = self.cfg, self.ranks
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        qk = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
        a = p + "self_attn."
        if rest in ("q_layernorm.weight", "linear_q_up_proj.layer_norm_weight"):
            return Replicated(Src(a + "q_a_layernorm.weight", (cfg.q_lora_rank,)))
        if rest in ("kv_layernorm.weight", "linear_kv_up_proj.layer_norm_weight"):
            return Replicated(Src(a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,)))
        if rest == "linear_q_proj.weight":
            return Split(Src(a + "q_proj.weight", (nh * qk, h)), 0, r.tp_rank, r.tp_size)
        if rest == "linear_q_down_proj.weight":
            src = Src(a + "q_a_proj.weight", (cfg.q_lora_rank, h))
            return RowsOrReplicated(src, r.tp_rank, r.tp_size)
        if rest == "linear_q_up_proj.weight":
            src = Src(a + "q_b_proj.weight", (nh * qk, cfg.q_lora_rank))
            return Split(src, 0, r.tp_rank, r.tp_size)
        if rest == "linear_kv_down_proj.weight":
            rows = cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
            src = Src(a + "kv_a_proj_with_mqa.weight", (rows, h))
            return RowsOrReplicated(src, r.tp_rank, r.tp_size)
        if rest == "linear_kv_up_proj.weight":
            rows = nh * (cfg.qk_head_dim + cfg.v_head_dim)
            src = Src(a + "kv_b_proj.weight", (rows, cfg.kv_lora_rank))
            return Split(src, 0, r.tp_rank, r.tp_size)
        if rest == "linear_proj.weight":
            src = Src(a + "o_proj.weight", (h, nh * cfg.v_head_dim))
            return Split(src, 1, r.tp_rank, r.tp_size)
        return None


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
        try:
            recipe.validate(reader, name)
        except CheckpointError as e:
            if name.startswith("mtp.") and "missing tensor" in str(e):
                raise CheckpointError(
                    f"{e}: config.json declares {model_cfg.mtp_num_layers} MTP layer(s) "
                    f"(num_nextn_predict_layers) stored as model.layers.{model_cfg.num_layers}+; "
                    "checkpoints saved by transformers drop them"
                ) from None
            raise
        if tuple(tensor.shape) != recipe.local_shape():
            raise CheckpointError(
                f"Megatron parameter {name!r} has shape {tuple(tensor.shape)} on this rank but "
                f"the checkpoint ({', '.join(recipe.sources())}) gives {recipe.local_shape()}"
            )
        recipes[name] = recipe
        used.update(recipe.sources())
    copies = _mtp_copies(model_cfg, reader)
    used.update(copy for copy, _ in copies)
    unused = [n for n in reader.names() if n not in used and not _IGNORED_HF.match(n)]
    if model_cfg.share_embeddings_and_output_weights:
        unused = [n for n in unused if n != "lm_head.weight"]
    if unused:
        logger.warning(
            "%s: %d HF tensors unused, e.g. %s", reader.directory, len(unused), unused[:5]
        )
    return HFLoadPlan(reader.directory, recipes, unused, copies)


def _mtp_copies(cfg: ModelConfig, reader: SafetensorsDir) -> list[tuple[str, str]]:
    """The MTP layers' copies of the embedding / output layer present in the checkpoint."""
    output = "model.embed_tokens.weight"
    if not cfg.share_embeddings_and_output_weights:
        output = "lm_head.weight"
    copies = []
    for i in range(cfg.num_layers, cfg.num_layers + (cfg.mtp_num_layers or 0)):
        for part, main in _MTP_COPIES.items():
            copy = f"model.layers.{i}.{part}"
            if copy in reader:
                main = main or output
                if reader.shape(copy) != reader.shape(main):
                    raise CheckpointError(
                        f"{reader.directory}: {copy!r} has shape {list(reader.shape(copy))}, "
                        f"{main!r} {list(reader.shape(main))}: MTP layers share the main model's"
                    )
                copies.append((copy, main))
    return copies


def _check_copies(plan: HFLoadPlan, reader: SafetensorsDir, ranks: ParallelRanks) -> None:
    """Checks this rank's share of rows of every MTP copy against the main tensor."""
    for copy, main in plan.copies:
        rows = reader.shape(main)[0]
        per = -(-rows // ranks.tp_size)
        start, stop = ranks.tp_rank * per, min(rows, (ranks.tp_rank + 1) * per)
        index = (slice(start, stop),)
        if stop > start and not torch.equal(reader.read(copy, index), reader.read(main, index)):
            raise CheckpointError(
                f"{reader.directory}: {copy!r} differs from {main!r}; Megatron's MTP layers "
                "use the main model's embedding and output layer, so a checkpoint whose MTP "
                "copies differ cannot be served"
            )


def stage_hf_weights(
    plan: HFLoadPlan, reader: SafetensorsDir, model: torch.nn.Module
) -> dict[str, torch.Tensor]:
    """Reads this rank's shards into host tensors in the parameters' dtypes."""
    _check_copies(plan, reader, ParallelRanks.from_model(_unwrap(model)))
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


def _load_with_bridge(model: torch.nn.Module, plan: HFLoadPlan, reader: SafetensorsDir) -> None:
    """Loads HF weights with megatron-bridge's AutoBridge (GPU images), then checks the
    replicated parameters (norms, routers) against the checkpoint, so a bridge that
    skipped parameters cannot go unnoticed."""
    bridge = AutoBridge.from_hf_pretrained(str(plan.directory))
    bridge.load_hf_weights([_unwrap(model)])
    targets = _unwrap(model).state_dict(keep_vars=True)
    for name, recipe in plan.recipes.items():
        if isinstance(recipe, Replicated):
            got = targets[name].detach().float().cpu()
            if not torch.allclose(got, recipe.read(reader).float(), rtol=1e-2, atol=1e-3):
                raise CheckpointError(f"megatron-bridge did not load {name!r} from the checkpoint")


def load_hf_weights(model: torch.nn.Module, model_cfg: ModelConfig, directory: str | Path) -> None:
    """Validates, then loads a HF safetensors checkpoint into ``model`` on this rank.

    Args:
        model: the built (possibly wrapped) GPTModel of this rank.
        model_cfg: the architecture the model was built from.
        directory: HF checkpoint directory (``config.json`` + safetensors).

    Raises:
        CheckpointError: the checkpoint does not fit the model. Found before any
            parameter is written; with megascore's reader the model is then unchanged
            (the AutoBridge path validates the same way but copies as it reads).
    """
    directory = Path(directory)
    with SafetensorsDir(directory) as reader:
        plan = plan_hf_load(model, model_cfg, reader)
        if use_bridge(model):
            logger.info("loading %s with megatron-bridge AutoBridge", directory)
            _load_with_bridge(model, plan, reader)
            return
        staged = stage_hf_weights(plan, reader, model)
    copy_into_model(model, staged)
    logger.info("loaded %d tensors from %s", len(staged), directory)

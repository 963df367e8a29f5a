"""Which HF tensors each Megatron-Core ``GPTModel`` parameter comes from.

:class:`ParamMapper` maps a Megatron state-dict name (local spec or TransformerEngine
spec) to a :class:`~megascore.checkpoint.recipes.Recipe` over HF tensor names, for this
rank's shard; :func:`mtp_copies` lists the MTP layers' copies of the embedding and output
layer. The layouts are described in docs/checkpoints.md; ``hf_weights`` validates and
applies the recipes.
"""

from __future__ import annotations

import re

from megascore.api.errors import CheckpointError
from megascore.checkpoint.optional_parts import shared_embedding_name
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
from megascore.model.config import ModelConfig

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


class ParamMapper:
    """Maps Megatron parameter names to recipes over HF tensor names."""

    def __init__(self, cfg: ModelConfig, reader: SafetensorsDir, ranks: ParallelRanks):
        self.cfg, self.reader, self.ranks = cfg, reader, ranks
        self.fused_experts = any(n.endswith("mlp.experts.gate_up_proj") for n in reader.names())
        self.embedding = shared_embedding_name(cfg, reader.names())

    def __call__(self, name: str, layer_offset: int) -> Recipe:
        cfg, r = self.cfg, self.ranks
        h, v = cfg.hidden_size, cfg.vocab_size
        if name == "embedding.word_embeddings.weight":
            return VocabRows(Src(self.embedding, (v, h)), r.tp_rank, r.tp_size)
        if name == "output_layer.weight":
            # tied embeddings: a last pipeline stage holds its own copy of the embedding
            tied = cfg.share_embeddings_and_output_weights
            head = self.embedding if tied else "lm_head.weight"
            return VocabRows(Src(head, (v, h)), r.tp_rank, r.tp_size)
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


def mtp_copies(cfg: ModelConfig, reader: SafetensorsDir) -> list[tuple[str, str]]:
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
                        f"{reader.file(copy)}: {copy!r} has shape {list(reader.shape(copy))}, "
                        f"{main!r} {list(reader.shape(main))}: MTP layers share the main model's"
                    )
                copies.append((copy, main))
    return copies

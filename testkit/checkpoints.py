"""Helpers shared by the checkpoint tests and their torchrun worker.

Tiny random HF models per supported family (weights rescaled so that logits
spread over several nats: HF's default 0.02 init gives near-uniform logprobs
that would hide conversion errors), and logprob extraction from both sides.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

VOCAB = 256
SEQ_LEN = 20  # divisible by TP: MoE models with TP > 1 run sequence parallel
COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    num_hidden_layers=2,
    vocab_size=VOCAB,
    max_position_embeddings=512,
)
# "deepseek_v3-qfull": deepseek_v3 without the query down-projection and without YaRN;
# "qwen3_moe-softmax": top-k of the softmax over all experts, not renormalised, every
# second layer MoE (decoder_sparse_step)
FAMILIES = (
    "llama",
    "qwen2",
    "mistral",
    "mixtral",
    "qwen3",
    "qwen3_moe",
    "qwen3_moe-softmax",
    "deepseek_v3",
    "deepseek_v3-qfull",
    "glm4_moe",
)
MOE_FAMILIES = (
    "mixtral",
    "qwen3_moe",
    "qwen3_moe-softmax",
    "deepseek_v3",
    "deepseek_v3-qfull",
    "glm4_moe",
)
MTP_FAMILIES = ("deepseek_v3", "deepseek_v3-qfull", "glm4_moe")
# Shared by deepseek_v3 and glm4_moe: sigmoid router with correction bias, a dense first
# layer, a shared expert, a scaling factor, one MTP layer after the 3 decoder layers.
SIGMOID_MOE = dict(
    num_hidden_layers=3,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    n_shared_experts=1,
    routed_scaling_factor=1.5,
    norm_topk_prob=True,
    num_nextn_predict_layers=1,
)


def hf_config(family: str):
    """A tiny transformers config of ``family``."""
    import transformers

    if family == "llama":
        return transformers.LlamaConfig(**COMMON, rope_theta=50000.0)
    if family == "qwen2":  # QKV bias, tied embeddings
        return transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
    if family == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=None, head_dim=32)
    if family == "mixtral":
        cfg = dict(COMMON, intermediate_size=32)
        return transformers.MixtralConfig(**cfg, num_local_experts=4, num_experts_per_tok=2)
    if family == "qwen3":  # QK-norm, no bias, head_dim != hidden / heads
        return transformers.Qwen3Config(**COMMON, head_dim=32)
    if family.startswith("qwen3_moe"):  # layer 0 dense (mlp_only_layers), renormalised top-k
        cfg = dict(COMMON, num_hidden_layers=3)
        softmax = family == "qwen3_moe-softmax"
        return transformers.Qwen3MoeConfig(
            **cfg,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[] if softmax else [0],
            decoder_sparse_step=2 if softmax else 1,
            norm_topk_prob=not softmax,
        )
    if family.startswith("deepseek_v3"):  # MLA (v_head_dim != qk dim), 2 expert groups
        cfg = dict(COMMON, **SIGMOID_MOE, num_key_value_heads=4)
        qfull = family == "deepseek_v3-qfull"
        return transformers.DeepseekV3Config(
            **cfg,
            q_lora_rank=None if qfull else 32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_group=2,
            topk_group=1,
            rope_parameters=dict(rope_type="default", rope_theta=5000.0) if qfull else YARN,
        )
    if family == "glm4_moe":  # partial rotary, QKV bias, QK-norm
        return transformers.Glm4MoeConfig(
            **dict(COMMON, **SIGMOID_MOE),
            partial_rotary_factor=0.5,
            attention_bias=True,
            use_qk_norm=True,
            n_group=1,
            topk_group=1,
        )
    raise ValueError(family)


YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=128,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)


def _rescale(named, gen) -> None:
    """Draws every tensor again: norms ~ 1 + 0.2 N, biases ~ 0.5 N (router correction
    biases 0.1 N), matrices ~ N * scale / sqrt(fan_in)."""
    with torch.no_grad():
        for name, p in named:
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif "e_score_correction_bias" in name:
                p.copy_(0.1 * noise)
            elif p.dim() == 1:  # biases
                p.copy_(0.5 * noise)
            else:
                scale = 1.0 if "embed" in name else 2.0
                p.copy_(noise * scale / p.shape[-1] ** 0.5)


def _named_tensors(module):
    """Parameters plus the router correction-bias buffers."""
    buffers = [(n, b) for n, b in module.named_buffers() if "e_score_correction_bias" in n]
    return [*module.named_parameters(), *buffers]


def make_hf_model(family: str, seed: int = 0, **overrides):
    """A tiny random ``*ForCausalLM`` with rescaled weights, in eval mode (``overrides``:
    config fields to change, e.g. ``vocab_size``)."""
    import transformers

    torch.manual_seed(seed)
    config = hf_config(family)
    config.update(overrides)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _rescale(_named_tensors(model), torch.Generator().manual_seed(seed))
    return model.eval()


def make_mtp_layers(model, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random MTP layers for a tiny deepseek_v3 / glm4_moe model, named as DeepSeek-V3
    stores them after the last decoder layer (transformers builds and saves none):
    ``model.layers.{L+i}.`` + a decoder layer's tensors, ``enorm``, ``hnorm``,
    ``eh_proj`` ``[H, 2H]``, ``shared_head.norm``, and copies of the embedding
    (``embed_tokens``) and output layer (``shared_head.head``)."""
    cfg = model.config
    layer_cls = type(model.model.layers[-1])
    gen = torch.Generator().manual_seed(100 + seed)
    h = cfg.hidden_size
    out = {}
    for i in range(cfg.num_nextn_predict_layers):
        p = f"model.layers.{cfg.num_hidden_layers + i}."
        layer = layer_cls(cfg, cfg.num_hidden_layers + i)
        own = {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h)}
        own = {n: torch.empty(shape) for n, shape in own.items()}
        own["shared_head.norm.weight"] = torch.empty(h)
        named = [*_named_tensors(layer), *own.items()]
        _rescale(named, gen)
        out.update({p + n: t.detach().clone() for n, t in _hub_layout(named)})
        out[p + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
        out[p + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    return out


def _hub_layout(named):
    """transformers >= 5 keeps experts stacked in memory (``experts.gate_up_proj``
    ``[E, 2F, H]``, ``experts.down_proj`` ``[E, H, F]``); checkpoints store them per expert."""
    for name, t in named:
        if name.endswith("experts.gate_up_proj"):
            base, f = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{base}{e}.gate_proj.weight", t[e, :f]
                yield f"{base}{e}.up_proj.weight", t[e, f:]
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                yield f"{base}{e}.down_proj.weight", t[e]
        else:
            yield name, t


def save_hf_model(model, family: str, directory: Path, seed: int = 0, **save_kwargs) -> None:
    """``save_pretrained`` plus, for MTP families, the MTP layers in ``mtp.safetensors``
    (added to the shard index)."""
    import json

    from safetensors.torch import save_file

    model.save_pretrained(directory, **save_kwargs)
    if family not in MTP_FAMILIES:
        return
    directory = Path(directory)
    tensors = make_mtp_layers(model, seed)
    save_file(tensors, str(directory / "mtp.safetensors"), metadata={"format": "pt"})
    index = directory / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
    else:
        data = {"metadata": {}, "weight_map": dict.fromkeys(_names(directory), "model.safetensors")}
    data["weight_map"].update(dict.fromkeys(tensors, "mtp.safetensors"))
    index.write_text(json.dumps(data))


def _names(directory: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def token_batch(seed: int = 0, batch: int = 3) -> torch.Tensor:
    """int64 ``[batch, SEQ_LEN]`` random token ids."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, VOCAB, (batch, SEQ_LEN), generator=gen)


def hf_logprobs(model, ids: torch.Tensor) -> np.ndarray:
    """float64 ``[b, s-1]``: log p(ids[:, t+1] | ids[:, :t+1]) from transformers."""
    with torch.no_grad():
        logits = model(ids).logits.double()
    lp = torch.log_softmax(logits, dim=-1)[:, :-1]
    return lp.gather(-1, ids[:, 1:, None])[..., 0].numpy()


def write_hf_checkpoint(family: str, directory: Path, seed: int = 0, **save_kwargs) -> np.ndarray:
    """Saves a tiny HF model to ``directory``; returns its reference logprobs on
    ``token_batch()`` (also stored as ``directory/reference.npy``)."""
    model = make_hf_model(family, seed)
    save_hf_model(model, family, directory, seed, **save_kwargs)
    ref = hf_logprobs(model, token_batch())
    np.save(Path(directory) / "reference.npy", ref)
    return ref


def megatron_logprobs(model, ids: torch.Tensor, tp_group) -> np.ndarray:
    """float64 ``[b, s-1]`` target logprobs of a Megatron GPTModel (vocab-parallel logits
    are all-gathered over ``tp_group``)."""
    b, s = ids.shape
    with torch.no_grad():
        logits = model(ids, torch.arange(s).expand(b, s), None)  # [b, s, V / tp]
        if dist.get_world_size(tp_group) > 1:
            parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
            dist.all_gather(parts, logits.contiguous(), group=tp_group)
            logits = torch.cat(parts, dim=-1)  # [b, s, V]
    lp = torch.log_softmax(logits.double(), dim=-1)[:, :-1]
    return lp.gather(-1, ids[:, 1:, None])[..., 0].numpy()


def engine_on_rank0(model: str, **parallel):
    """A ``DistributedEngine`` serving ``model`` on the CPU (``parallel``: EngineConfig
    sizes) on rank 0; None on the other ranks, after their worker loop has ended (when
    rank 0 shuts the engine down)."""
    from megascore.config import EngineConfig
    from megascore.engine.runtime import DistributedEngine

    cfg = EngineConfig(model=model, device="cpu", collective_timeout_s=60, **parallel)
    engine = DistributedEngine.create(cfg)
    if dist.get_rank() != 0:
        engine.worker_loop()
        return None
    return engine


def engine_logprobs(engine, ids: torch.Tensor) -> np.ndarray:
    """``[b, s-1]`` target logprobs of the rows of ``ids`` scored by ``engine`` (like the
    references)."""
    from megascore.api.types import ScoreBatch

    lengths = np.full(len(ids), ids.shape[1])
    out = engine.score(ScoreBatch(token_ids=ids.reshape(-1).numpy(), lengths=lengths))
    return out.logprobs.reshape(ids.shape)[:, 1:]


# Non-square and smaller than DeepSeek's 128 x 128 so that the tiny model's matrices have
# several blocks, partial last blocks, and TP=2 slices starting inside a block.
FP8_BLOCK = (32, 24)
_FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_block_fp8(weight: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block quantisation: per ``block`` the scale maps its amax onto the FP8
    range; returns ``(float8_e4m3fn weight, float32 weight_scale_inv)``."""
    rows, cols = weight.shape
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(nr * block[0], nc * block[1])
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(nr, block[0], nc, block[1])
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / _FP8_MAX  # [nr, nc]
    q = (blocks / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(nr * block[0], nc * block[1])[:rows, :cols].contiguous(), scale_inv


def _is_fp8_weight(name: str) -> bool:
    """What DeepSeek-V3 stores in FP8: the attention / MLP / expert projections (not the
    embedding, output layer, norms or router)."""
    return name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")


def quantize_checkpoint_fp8(directory: Path, block=FP8_BLOCK) -> dict[str, torch.Tensor]:
    """Rewrites a saved HF checkpoint in DeepSeek-V3's FP8 block layout: every projection
    ``X.weight`` becomes ``F8_E4M3`` plus ``X.weight_scale_inv``, and config.json gets the
    ``quantization_config``. Returns the dequantised values of the quantised tensors
    (what a model serving the checkpoint holds)."""
    import json

    from safetensors.torch import load_file, save_file

    directory = Path(directory)
    dequantised = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors = load_file(str(path))
        out = {}
        for name, t in tensors.items():
            if not _is_fp8_weight(name):
                out[name] = t
                continue
            q, scale_inv = quantize_block_fp8(t, block)
            out[name], out[name + "_scale_inv"] = q, scale_inv
            rows, cols = t.shape
            expanded = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
            dequantised[name] = q.float() * expanded[:rows, :cols]
        save_file(out, str(path), metadata={"format": "pt"})
    index = directory / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        for name in dequantised:
            data["weight_map"][name + "_scale_inv"] = data["weight_map"][name]
        index.write_text(json.dumps(data))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return dequantised


def load_dequantised(model, dequantised: dict[str, torch.Tensor]) -> None:
    """Puts the dequantised checkpoint values into the transformers ``model`` (in memory
    its experts may be stacked: ``experts.gate_up_proj`` / ``experts.down_proj``); the MTP
    layers' tensors, which the model does not hold, are skipped."""
    state = model.state_dict()
    with torch.no_grad():
        for name, value in dequantised.items():
            if name in state:
                state[name].copy_(value)
                continue
            base, expert, proj = _split_expert_name(name)
            if base is None or base + "gate_up_proj" not in state:
                continue  # an MTP layer
            if proj == "down_proj":
                state[base + "down_proj"][expert].copy_(value)
            else:
                half = state[base + "gate_up_proj"].shape[1] // 2
                rows = slice(0, half) if proj == "gate_proj" else slice(half, 2 * half)
                state[base + "gate_up_proj"][expert, rows].copy_(value)


def _split_expert_name(name: str):
    """``...experts.E.gate_proj.weight`` -> (``...experts.``, E, ``gate_proj``)."""
    import re

    m = re.fullmatch(r"(.*experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
    return (m[1], int(m[2]), m[3]) if m else (None, None, None)

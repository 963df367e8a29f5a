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
FAMILIES = ("llama", "qwen2", "mistral", "mixtral")


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
    raise ValueError(family)


def make_hf_model(family: str, seed: int = 0):
    """A tiny random ``*ForCausalLM`` with rescaled weights, in eval mode."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif p.dim() == 1:  # biases
                p.copy_(0.5 * noise)
            else:
                scale = 1.0 if "embed" in name else 2.0
                p.copy_(noise * scale / p.shape[-1] ** 0.5)
    return model.eval()


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
    model.save_pretrained(directory, **save_kwargs)
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

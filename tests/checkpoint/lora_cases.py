"""peft adapters for the tiny HF checkpoints, and a packed forward with per-sequence
adapters: shared by ``test_lora.py`` and its torchrun worker (``scripts/lora_worker.py``).

peft initialises ``lora_B`` to zero (an adapter that changes nothing); every adapter here
draws all of its LoRA tensors from a seeded generator before ``save_pretrained``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from testkit.checkpoints import hf_logprobs, make_hf_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]
FOUR = {  # name -> (seed, LoraConfig fields): the served tests' four adapters
    "a": (1, dict(r=8, lora_alpha=16, target_modules=ALL)),
    "b": (2, dict(r=16, lora_alpha=8, use_rslora=True, target_modules=ALL)),
    "c": (3, dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "up_proj"])),
    "d": (4, dict(r=8, lora_alpha=16, target_modules=ATTENTION)),
}


def peft_model(family: str, seed: int = 0, **lora):
    """The family's tiny HF model (the weights of ``write_hf_checkpoint(family)``) under a
    peft LoRA of ``lora`` (``LoraConfig`` fields), its LoRA tensors drawn from ``seed``."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(make_hf_model(family), LoraConfig(**lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # [r, in] and [out, r]: entries ~ 0.5 N / sqrt(fan in)
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / p.shape[-1] ** 0.5)
    return model.eval()


def write_adapter(family: str, directory: Path, ids: torch.Tensor, seed: int = 0, **lora):
    """Saves a :func:`peft_model` adapter to ``directory``; returns the float64 ``[b, s-1]``
    logprobs of ``ids`` under transformers + peft and under the base alone."""
    model = peft_model(family, seed, **lora)
    model.save_pretrained(directory)
    with model.disable_adapter():
        base = hf_logprobs(model, ids)
    return hf_logprobs(model, ids), base


def packed_logits(model, pgs, seqs: list[torch.Tensor], slots: list[int]) -> list[torch.Tensor]:
    """Each sequence's ``[len, V]`` logits from one packed forward, sequence ``b`` under
    adapter slot ``slots[b]`` (-1: base)."""
    from megascore.model.lora import attach, sequence_rows
    from tests.packed_forward import forward_packed, full_logits, pack_for_rank

    lengths = [len(s) for s in seqs]
    tp, cp = pgs.tp.size(), pgs.cp.size()
    multiple = (2 * cp if cp > 1 else 1) * (tp if model.config.sequence_parallel else 1)
    packed = pack_for_rank(torch.cat(seqs), lengths, pgs, pad_multiple=multiple)
    index = sequence_rows(slots, packed.cu_seqlens_padded, packed.shard_indices)
    with attach(model).rows(index):
        out = forward_packed(model, packed)
    logits = full_logits(out, packed, pgs).clone()  # the head's buffers are reused
    starts = packed.cu_seqlens_padded.tolist()
    return [logits[s : s + n] for s, n in zip(starts, lengths, strict=False)]


def logprobs(logits: list[torch.Tensor], seqs: list[torch.Tensor]) -> np.ndarray:
    """float64 ``[b, s-1]`` target logprobs (sequences of one length)."""
    out = []
    for rows, ids in zip(logits, seqs, strict=True):
        lp = torch.log_softmax(rows.double(), dim=-1)[:-1]
        out.append(lp.gather(-1, ids[1:, None])[:, 0])
    return torch.stack(out).numpy()

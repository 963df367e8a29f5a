"""torchrun worker (2 gloo ranks) for tests/checkpoint/test_lora_parallel.py.

``WORK`` holds ``hf_<family>/`` (the tiny HF checkpoints) and ``ad_<case>/`` (peft
adapters of ``lora_cases``). For each layout (TP=2: llama, and qwen3_moe with sequence
parallelism; EP=2: qwen3_moe; CP=2: llama, each rank's rows its CP shard's; PP=2:
llama, the stages' hidden states sent by hand) the
family's model is loaded, made batch-invariant, given the family's two adapters, and
``token_batch()`` is scored in one packed forward with the sequences under
``[first adapter, base, second adapter]``. The rank holding the logits writes
``out/<layout>_<family>.npy`` (float64 ``[3, 19]`` logprobs); an exception goes to
``out/<layout>_<family>.rank<r>.error``.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # testkit

from testkit.checkpoints import token_batch  # noqa: E402

ADAPTERS = {  # family -> the adapter cases of its first and second slot
    "llama": ("llama-r8", "llama-r16-rslora"),
    "qwen3_moe": ("qwen3_moe-r16-rslora", "qwen3_moe-qv"),
}
LAYOUTS = {  # name -> (EngineConfig sizes, families)
    "tp2": (dict(tensor_model_parallel_size=2), ("llama", "qwen3_moe")),
    "ep2": (dict(expert_model_parallel_size=2), ("qwen3_moe",)),
    "cp2": (dict(context_parallel_size=2), ("llama",)),
    "pp2": (dict(pipeline_model_parallel_size=2), ("llama",)),
}


def _model(work: Path, family: str, engine_cfg, pgs):
    from megascore.checkpoint import resolve_model
    from megascore.checkpoint.lora_weights import load_adapter
    from megascore.model.batch_invariant import make_batch_invariant
    from megascore.model.build import build_model

    cfg, load, _ = resolve_model(f"hf:{work / f'hf_{family}'}")
    model = build_model(cfg, engine_cfg, pgs, random_weights=False)
    make_batch_invariant(model)
    load(model)
    slots = [load_adapter(model, cfg, case, work / f"ad_{case}") for case in ADAPTERS[family]]
    return model, [slots[0], -1, slots[1]]


def _pipelined(model, pgs, seqs, slots) -> np.ndarray | None:
    """Two stages by hand: stage 0's hidden states sent to stage 1, which scores them."""
    from megascore.engine.schedule.forward import forward_microbatch, scoring_forward
    from megascore.model.lora import attach, sequence_rows
    from tests.checkpoint.lora_cases import logprobs
    from tests.packed_forward import pack_for_rank

    packed = pack_for_rank(torch.cat(seqs), [len(s) for s in seqs], pgs)
    index = sequence_rows(slots, packed.cu_seqlens_padded, packed.shard_indices)
    stage, ranks = pgs.pp.rank(), dist.get_process_group_ranks(pgs.pp)
    hidden = torch.empty(packed.input_ids.shape[1], 1, model.config.hidden_size)
    with scoring_forward(model, return_moe_metrics=False, return_mtp_metrics=False):
        with attach(model).rows(index):
            if stage == 0:
                dist.send(forward_microbatch(model, packed).contiguous(), ranks[1])
                return None
            dist.recv(hidden, ranks[0])
            model.set_input_tensor(hidden)
            head = forward_microbatch(model, packed)
    logits = head.logits(0, head.num_tokens)
    starts = packed.cu_seqlens_padded.tolist()
    return logprobs([logits[s : s + len(q)] for s, q in zip(starts[:-1], seqs, strict=True)], seqs)


def _score(work: Path, layout: str, family: str, engine_cfg, pgs) -> np.ndarray | None:
    from tests.checkpoint.lora_cases import logprobs, packed_logits

    model, slots = _model(work, family, engine_cfg, pgs)
    seqs = list(token_batch())
    if layout == "pp2":
        return _pipelined(model, pgs, seqs, slots)
    return logprobs(packed_logits(model, pgs, seqs, slots), seqs)


def main() -> None:
    from megascore.config import EngineConfig
    from megascore.model.parallel import destroy_parallel, initialize_parallel

    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    for layout, (sizes, families) in LAYOUTS.items():
        engine_cfg = EngineConfig(device="cpu", **sizes)
        pgs = initialize_parallel(engine_cfg)
        for family in families:
            case = f"{layout}_{family}"
            try:
                result = _score(work, layout, family, engine_cfg, pgs)
            except Exception:
                (out / f"{case}.rank{dist.get_rank()}.error").write_text(traceback.format_exc())
                raise
            if result is not None and (dist.get_rank() == 0 or layout == "pp2"):
                np.save(out / f"{case}.npy", result)
        destroy_parallel()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

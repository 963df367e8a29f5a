"""torchrun worker (4 gloo ranks) for tests/checkpoint/test_pipeline_load.py.

``WORK`` holds ``hf_<family>/`` (HF checkpoints with ``reference.npy``; ``llama_b`` is
llama with other weights). Phases:

* TP=2 (x DP=2): load ``hf_<family>`` and save it as a Megatron checkpoint
  ``mg_tp2_<family>`` (every rank writes its shards).
* DistributedEngine at PP=2 and at PP=2 x TP=2: serve ``hf:hf_<start>`` (llama: the
  other weights ``llama_b``; qwen2 has tied embeddings, so its last stage holds a copy
  of the embedding), score, then ``LoadWeights("megatron:mg_tp2_<family>")`` on every
  rank (each stage reads its own layers of the TP=2 checkpoint) and score again.

Rank 0 writes ``out/<case>.npy``; any exception is written to ``out/<case>.error``.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import numpy as np
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # testkit

from testkit.checkpoints import engine_logprobs, engine_on_rank0, token_batch  # noqa: E402

FAMILIES = {"llama": "llama_b", "qwen2": "qwen2"}  # family -> checkpoint served first
LAYOUTS = {"pp2": (1, 2), "pp2_tp2": (2, 2)}  # name -> (tp, pp)


def _save_tp2(work: Path) -> None:
    from megascore.checkpoint.megatron_ckpt import save_checkpoint
    from megascore.checkpoint.resolve import resolve_model
    from megascore.config import EngineConfig
    from megascore.model.build import build_model
    from megascore.model.parallel import destroy_parallel, initialize_parallel

    engine_cfg = EngineConfig(device="cpu", tensor_model_parallel_size=2)
    pgs = initialize_parallel(engine_cfg)
    for family in FAMILIES:
        cfg, load, _ = resolve_model(f"hf:{work / f'hf_{family}'}")
        model = build_model(cfg, engine_cfg, pgs)
        load(model)
        save_checkpoint(model, cfg, work / f"mg_tp2_{family}", weights_version=f"tp2-{family}")
    destroy_parallel()


def _serve(work: Path, out: Path, layout: str, family: str) -> None:
    tp, pp = LAYOUTS[layout]
    engine = engine_on_rank0(
        f"hf:{work / f'hf_{FAMILIES[family]}'}",
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
    )
    if engine is None:
        return
    ids = token_batch()

    def score(case: str) -> None:
        np.save(out / f"{case}.npy", engine_logprobs(engine, ids))

    try:
        assert engine.info().parallel.pipeline_model_parallel_size == pp
        score(f"hf_{layout}_{FAMILIES[family]}")
        version = engine.load_weights(f"megatron:{work / f'mg_tp2_{family}'}", "")
        assert version == f"tp2-{family}", version
        score(f"mg_tp2_to_{layout}_{family}")
    except Exception:
        (out / f"{layout}_{family}.error").write_text(traceback.format_exc())
        raise
    finally:
        engine.shutdown()


def main() -> None:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    _save_tp2(work)
    for layout in LAYOUTS:
        for family in FAMILIES:
            _serve(work, out, layout, family)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Shared prefixes vs the dense forward for multi-latent attention in parallel layouts
of DistributedEngine (2 gloo ranks).

The model is the tiny ``deepseek_v3`` ``hf:`` checkpoint given as the second argument
(MLA with a query LoRA and YaRN RoPE, sigmoid-router MoE, one MTP layer). For TP2
(sequence parallel: a MoE model), CP2 and PP2 (3 layers: 2 + 1, up to 4 microbatches),
one engine with ``prefix_sharing=False`` and one with it on (``min_shared_prefix`` 8)
score the batch of tests/unit/test_prefix_sharing_mla.py (seeded per layout): the shared
engine's logprobs, top-k and losses are within 1e-6 (fp32) of the dense engine's, the
recorded routes equal, the MoE / MTP metrics of a shared step within 1e-6 relative,
and its attention did attend to shared prefix rows (the metrics step's too).

Check outcomes go to ``OUT_DIR/prefix_mla_rank{r}.json``.
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
from pathlib import Path

import torch.distributed as dist
from engine_common import CheckLog

from megascore.config import EngineConfig
from megascore.engine.runtime import DistributedEngine
from tests.prefix_groups import (
    MIN_SHARED,
    assert_same_metrics,
    assert_same_scores,
    spy_prefix_attention,
)
from tests.unit.test_prefix_sharing_mla import mla_batch

# name -> (tp, cp, pp)
LAYOUTS = {"tp2": (2, 1, 1), "cp2": (1, 2, 1), "pp2": (1, 1, 2)}


def with_engine(model: str, spec, sharing: bool, rank: int, work):
    """``work(engine)`` on rank 0 of an engine in layout ``spec`` (the workers serve it)."""
    tp, cp, pp = spec
    engine = DistributedEngine.create(
        EngineConfig(
            model=model,
            tensor_model_parallel_size=tp,
            context_parallel_size=cp,
            pipeline_model_parallel_size=pp,
            prefix_sharing=sharing,
            min_shared_prefix=MIN_SHARED,
            logprob_chunk_tokens=64,
            collective_timeout_s=60.0,
        )
    )
    if rank != 0:
        engine.worker_loop()
        return None
    try:
        return work(engine)
    finally:
        engine.shutdown()


def run_layout(name: str, model: str, spec, rank: int) -> None:
    batch = mla_batch(seed=len(name))
    metrics = dataclasses.replace(batch, return_moe_metrics=True, return_mtp_metrics=True)

    def dense_work(engine):
        return engine.score(batch), engine.score(metrics)

    def shared_work(engine):
        out = engine.score(batch)
        before = len(seen)
        with_metrics = engine.score(metrics)
        return engine.step_cfg.min_shared_prefix, out, with_metrics, any(seen[before:])

    with spy_prefix_attention() as seen:
        dense = with_engine(model, spec, False, rank, dense_work)
        assert not any(seen), "the dense engine attended to prefix rows"
        shared = with_engine(model, spec, True, rank, shared_work)
    if rank != 0:
        return
    min_shared, out, with_metrics, metrics_shared = shared
    assert min_shared == MIN_SHARED, min_shared
    assert any(seen), "the shared engine never attended to prefix rows"
    assert metrics_shared, "the metrics step did not attend to prefix rows"
    assert_same_scores(out, dense[0])
    assert_same_metrics(with_metrics, dense[1])


def main(out_dir: Path, model: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    log = CheckLog(out_dir / f"prefix_mla_rank{rank}.json")
    for name, spec in LAYOUTS.items():
        log.run(name, run_layout, name, model, spec, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), f"hf:{sys.argv[2]}")

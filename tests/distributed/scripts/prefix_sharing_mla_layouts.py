"""Shared prefixes vs the dense forward of ``hf:`` families in parallel layouts of
DistributedEngine (2 gloo ranks).

The models are the tiny checkpoints given as ``family=DIR`` arguments: ``deepseek_v3``
(MLA with a query LoRA and YaRN RoPE, sigmoid-router MoE, one MTP layer) and
``qwen3_moe`` (GQA with QK norms, softmax-router MoE). For TP2 (sequence parallel: a
MoE model), CP2, EP2 (two data-parallel ranks splitting the step by groups) and PP2
(3 layers: 2 + 1, up to 4 microbatches),
one engine with ``prefix_sharing=False`` and one with it on (``min_shared_prefix`` 8)
score the batch of tests/unit/test_prefix_sharing_mla.py (seeded per layout): the shared
engine's logprobs, top-k and losses are within 1e-6 (fp32) of the dense engine's, the
recorded routes equal, the MoE / MTP metrics of a shared step within 1e-6 relative,
and its attention did attend to shared prefix rows (the metrics step's too).

Check outcomes go to ``OUT_DIR/prefix_mla_rank{r}.json``, named ``family layout``.
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
from pathlib import Path

import torch.distributed as dist
from engine_common import CheckLog
from prefix_sharing_layouts import with_engine

from tests.prefix_groups import (
    MIN_SHARED,
    assert_same_metrics,
    assert_same_scores,
    spy_prefix_attention,
)
from tests.unit.test_prefix_sharing_mla import mla_batch

# name -> (tp, cp, ep, pp)
LAYOUTS = {"tp2": (2, 1, 1, 1), "cp2": (1, 2, 1, 1), "ep2": (1, 1, 2, 1), "pp2": (1, 1, 1, 2)}


def run_layout(name: str, model: str, spec, rank: int) -> None:
    batch = mla_batch(seed=len(name))

    def metrics(engine):  # MoE metrics, and MTP metrics where the model has MTP layers
        mtp = bool(engine.info().mtp_metric_names)
        return dataclasses.replace(batch, return_moe_metrics=True, return_mtp_metrics=mtp)

    def dense_work(engine):
        return engine.score(batch), engine.score(metrics(engine))

    def shared_work(engine):
        out = engine.score(batch)
        before = len(seen)
        with_metrics = engine.score(metrics(engine))
        return engine.step_cfg.min_shared_prefix, out, with_metrics, any(seen[before:])

    with spy_prefix_attention() as seen:
        dense = with_engine((model, *spec), False, rank, dense_work)
        assert not any(seen), "the dense engine attended to prefix rows"
        shared = with_engine((model, *spec), True, rank, shared_work)
    if rank != 0:
        return
    min_shared, out, with_metrics, metrics_shared = shared
    assert min_shared == MIN_SHARED, min_shared
    assert any(seen), "the shared engine never attended to prefix rows"
    assert metrics_shared, "the metrics step did not attend to prefix rows"
    assert_same_scores(out, dense[0])
    assert_same_metrics(with_metrics, dense[1], mtp=bool(dense[1].mtp_metrics))


def main(out_dir: Path, models: list[str]) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    log = CheckLog(out_dir / f"prefix_mla_rank{rank}.json")
    for family, directory in (m.split("=", 1) for m in models):
        for name, spec in LAYOUTS.items():
            log.run(f"{family} {name}", run_layout, name, f"hf:{directory}", spec, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])

"""Shared prefixes vs the dense forward in parallel layouts of DistributedEngine (2 gloo ranks).

For every layout, one engine with ``prefix_sharing=False`` and one with it on
(``min_shared_prefix`` 8) score :func:`tests.prefix_groups.prefix_group_batch`:

* TP2 (tiny), TP2 with sequence parallelism, EP2, PP2 and CP2 (tiny-moe, routing
  recorded; PP2 in up to 4 microbatches, the groups interleaved in the batch) and CP2
  (tiny): shared within 1e-6 of dense (fp32), top-k ids and recorded routes equal, and
  the shared engine's replay of its own routes is bit-identical to its recording forward;
* tiny-moe: a step with MoE and MTP metrics (aux, sequence aux and z losses, MTP loss
  and acceptance) computed shared gives the dense step's metrics within 1e-6 relative;
  so do the metric sums of two shared steps that score half of its sequences each,
  added (what the server's batcher does with a request over several steps), the
  acceptance rate exactly;
* the shared engine's attention did attend to shared prefix rows in every layout, the
  metrics step's too (at EP2 the two ranks are data-parallel: each computes the
  prefixes of its groups).

Check outcomes go to ``OUT_DIR/prefix_rank{r}.json``.
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist
from engine_common import CheckLog

from megascore.config import EngineConfig
from megascore.engine.runtime import DistributedEngine
from megascore.engine.schedule.data_parallel import sub_batch
from tests.prefix_groups import (
    MIN_SHARED,
    assert_same_metrics,
    assert_same_scores,
    prefix_group_batch,
    spy_prefix_attention,
)

# name -> (model, tp, cp, ep, pp)
LAYOUTS = {
    "tp2": ("tiny", 2, 1, 1, 1),
    "moe_tp2_sp": ("tiny-moe", 2, 1, 1, 1),  # sequence parallelism: on for MoE at TP > 1
    "ep2": ("tiny-moe", 1, 1, 2, 1),
    "pp2": ("tiny-moe", 1, 1, 1, 2),
    "cp2": ("tiny", 1, 2, 1, 1),
    "moe_cp2": ("tiny-moe", 1, 2, 1, 1),
}


def with_engine(spec, sharing: bool, rank: int, work):
    """``work(engine)`` on rank 0 of an engine in layout ``spec`` (the workers serve it)."""
    model, tp, cp, ep, pp = spec
    engine = DistributedEngine.create(
        EngineConfig(
            model=model,
            tensor_model_parallel_size=tp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            pipeline_model_parallel_size=pp,
            prefix_sharing=sharing,
            min_shared_prefix=MIN_SHARED,
            prefix_cache_gib=0,  # the step's own sharing (the cache: prefix_cache_layouts.py)
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


def run_layout(name: str, spec, rank: int) -> None:
    moe = spec[0] == "tiny-moe"
    batch = prefix_group_batch(seed=len(name), return_routing=moe)

    metrics = dataclasses.replace(batch, return_moe_metrics=True, return_mtp_metrics=True)

    def dense_work(engine):
        return engine.score(batch), engine.score(metrics) if moe else None

    def shared_work(engine):
        out = engine.score(batch)
        # replaying the shared forward's own routes reproduces it bit for bit
        again = engine.score(dataclasses.replace(batch, routing=out.routing)) if moe else None
        before = len(seen)
        with_metrics = engine.score(metrics) if moe else None
        if moe:  # the same sequences in two steps: their sums add up to the whole step's
            every = np.arange(metrics.num_sequences)
            halves = [sub_batch(metrics, every[::2]), sub_batch(metrics, every[1::2])]
            sums = [engine.score(half).metric_sums for half in halves]
            moe_metrics, mtp_metrics = (sums[0] + sums[1]).values()
            with_metrics = (with_metrics, moe_metrics, mtp_metrics)
        return engine.step_cfg.min_shared_prefix, out, again, with_metrics, any(seen[before:])

    with spy_prefix_attention() as seen:
        dense, dense_metrics = with_engine(spec, False, rank, dense_work) or (None, None)
        assert not any(seen), "the dense engine attended to prefix rows"
        shared = with_engine(spec, True, rank, shared_work)
    if rank != 0:
        return
    min_shared, out, again, with_metrics, metrics_shared = shared
    assert min_shared == MIN_SHARED, min_shared
    assert any(seen), "the shared engine never attended to prefix rows"
    assert_same_scores(out, dense)
    if moe:
        assert np.array_equal(again.logprobs, out.logprobs)
        assert np.array_equal(again.top_k_logprobs, out.top_k_logprobs)
        assert np.array_equal(again.routing, out.routing)
        assert metrics_shared, "the metrics step did not attend to prefix rows"
        whole, moe_metrics, mtp_metrics = with_metrics
        assert_same_metrics(whole, dense_metrics)
        in_two = dataclasses.replace(whole, moe_metrics=moe_metrics, mtp_metrics=mtp_metrics)
        assert_same_metrics(in_two, dense_metrics)
        rate = "mtp_1_acceptance_rate"
        assert mtp_metrics[rate] == dense_metrics.mtp_metrics[rate], (mtp_metrics, rate)


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    log = CheckLog(out_dir / f"prefix_rank{rank}.json")
    for name, spec in LAYOUTS.items():
        log.run(name, run_layout, name, spec, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""The prefix cache in parallel layouts of DistributedEngine (2 gloo ranks).

For every layout, one engine that keeps nothing and shares nothing
(``prefix_cache=False, prefix_sharing=False``) and one with the cache score the requests of
:func:`tests.prefix_cache_cases.cache_workload` one by one: every output equal bit for bit
(batch-invariant CPU defaults, the key-block attention on both), and the cache engine
read cached tokens. Layouts: TP2 (tiny), TP2 with sequence parallelism (tiny-moe), PP2
(tiny-moe, 2 microbatches), EP2 (tiny-moe: two data-parallel ranks, which EP needs
here, each holding every cached block), and TP2 with a device tier of a few blocks and a
host tier behind it (:func:`tests.prefix_cache_cases.host_tier_workload`: blocks move out
and back on both ranks). Under CP the cache is off (docs/engine.md "Prefix cache"): CP2
checks that it is, and that it stays exact.

Check outcomes go to ``OUT_DIR/cache_rank{r}.json``.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist
from engine_common import CheckLog

from megascore.config import EngineConfig
from megascore.engine.runtime import DistributedEngine
from tests.prefix_cache_cases import (
    BLOCK,
    assert_same_outputs,
    cache_workload,
    host_tier_workload,
)

# name -> (model, tp, cp, ep, pp, microbatches)
LAYOUTS = {
    "tp2": ("tiny", 2, 1, 1, 1, 1),
    "moe_tp2_sp": ("tiny-moe", 2, 1, 1, 1, 1),
    "ep2": ("tiny-moe", 1, 1, 2, 1, 1),
    "pp2": ("tiny-moe", 1, 1, 1, 2, 2),
    "cp2": ("tiny", 1, 2, 1, 1, 1),
    "tp2_host": ("tiny", 2, 1, 1, 1, 1),
}
HOST_TIER = dict(prefix_cache_gib=8 * 2**12 / 2**30, prefix_cache_host_gib=2**20 / 2**30)
"""tp2_host: 8 slots of tiny's 4 KiB per rank at TP2 (blocks of 16), a host tier of 256."""
OFF = dict(prefix_cache=False, prefix_sharing=False)


def answers(spec, rank: int, requests, **options):
    """Rank 0: each request's output and the cache's stats (the workers serve)."""
    model, tp, cp, ep, pp, microbatches = spec
    engine = DistributedEngine.create(
        EngineConfig(
            model=model,
            tensor_model_parallel_size=tp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            pipeline_model_parallel_size=pp,
            pipeline_microbatches=microbatches,
            attention_block=BLOCK,
            min_shared_prefix=8,
            collective_timeout_s=60.0,
            **options,
        )
    )
    if rank != 0:
        engine.worker_loop()
        return None
    try:
        return [engine.score(r) for r in requests], engine.prefix_cache_stats()
    finally:
        engine.shutdown()


def run_layout(name: str, spec, rank: int) -> None:
    host = name == "tp2_host"
    requests = host_tier_workload() if host else cache_workload(seed=len(name))
    off = answers(spec, rank, requests, **OFF)
    on = answers(spec, rank, requests, **(HOST_TIER if host else {}))
    if rank != 0:
        return
    (want, _), (got, stats) = off, on
    if name == "cp2":  # no cache: the step's own sharing (within rounding)
        assert stats is None, stats
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, err_msg=f"request {i}")
            assert not a.values["cached_tokens"].any()
        return
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_same_outputs(a, b, f"request {i}")
    assert stats["hit_tokens"] > 0, stats
    if host:
        assert stats["demotions"] > 0 and stats["promotions"] > 0, stats
    assert sum(int(o.values["cached_tokens"].sum()) for o in got) == stats["hit_tokens"]


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    log = CheckLog(out_dir / f"cache_rank{rank}.json")
    for name, spec in LAYOUTS.items():
        log.run(name, run_layout, name, spec, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

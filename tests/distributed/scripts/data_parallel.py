"""Data-parallel ranks split a step: one launch per world size, the same batches everywhere.

Run on 1 rank (the reference: the whole batch on one rank) and on 2 ranks (tiny-moe at
EP=2 and tiny at DP=2 without EP: every step split across the two DP ranks). Rank 0
writes ``OUT_DIR/<case>.npz/.json`` per case; the test compares the 2-rank files with
the 1-rank ones. Cases:

* ``moe_edge``: the edge-case batch with MoE / MTP metrics and top-k;
* ``moe_one``: one sequence (fewer than the DP ranks: rank 1 runs only padding) with
  metrics and the routing recorded;
* ``moe_record``: the edge-case batch, routing recorded;
* ``moe_replay``: the edge-case batch replaying the 1-rank launch's recorded routing
  shifted by one expert (not what the router would choose), so equal results mean the
  replayed experts were used on every DP rank;
* ``moe_mb2``: two microbatches per step;
* ``moe_mb2_pad``: two microbatches, the second of one sequence: DP rank 1 runs an
  all-padding microbatch next to rank 0's second one;
* ``dense_edge``: tiny (no EP) at DP = 2.

The 2-rank launch also records on every rank which sequences each DP rank scored
(``split_rank{r}.json``): the test checks that the ranks scored different sequences.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist
from engine_common import CheckLog, edge_case_batch, layout_config, save_output

from megascore.engine.runtime import DistributedEngine
from megascore.engine.schedule import data_parallel


def cases(routing_dir: Path) -> dict:
    # losses in a request's own order, not the broadcast's (a map output's keys)
    edge = dataclasses.replace(edge_case_batch(moe=True), losses=("perplexity", "nll", "mean_nll"))
    one = edge_case_batch(moe=True, lengths=(37,))
    record = dataclasses.replace(edge, return_moe_metrics=False, return_mtp_metrics=False)
    out = {
        "moe_edge": edge,
        "moe_one": dataclasses.replace(one, return_routing=True),
        "moe_record": dataclasses.replace(record, return_routing=True),
    }
    recorded = routing_dir / "moe_record_routing.npy"
    if recorded.exists():  # the 2-rank launch replays the 1-rank launch's routing, shifted
        routing = (np.load(recorded) + 1) % 4  # tiny-moe: 4 experts; top-2 stay distinct
        out["moe_replay"] = dataclasses.replace(record, routing=routing, return_routing=True)
    return out


def run_model(model: str, ep: int, batches: dict, out_dir: Path, rank: int, **kwargs) -> None:
    engine = DistributedEngine.create(layout_config(model, 1, 1, ep, **kwargs))
    if rank != 0:
        engine.worker_loop()
        return
    try:
        for name, batch in batches.items():
            out = engine.score(batch)
            save_output(out_dir / name, out)
            if out.routing is not None:
                np.save(out_dir / f"{name}_routing.npy", out.routing)
    finally:
        engine.shutdown()


def main(out_dir: Path, routing_dir: Path) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    log = CheckLog(out_dir / f"data_parallel_rank{rank}.json")
    seen = []
    original = data_parallel.sub_batch

    def spy(batch, seq_idx, block=0):  # what each DP rank scores (rank 0 builds all)
        seen.append([int(i) for i in seq_idx])
        return original(batch, seq_idx, block)

    data_parallel.sub_batch = spy
    moe = cases(routing_dir)
    log.run("moe", run_model, "tiny-moe", world, moe, out_dir, rank)
    # 2 microbatches: one rank runs {0, 1} then {2, 3}, each DP rank one sequence of each;
    # of (9, 8, 7) one rank runs {0, 1} then {2}: DP rank 1 has no sequence in the second
    mb2 = {
        "moe_mb2": edge_case_batch(moe=True, lengths=(8, 8, 8, 8)),
        "moe_mb2_pad": edge_case_batch(moe=True, lengths=(9, 8, 7)),
    }
    log.run("moe_mb2", lambda: run_model(
        "tiny-moe", world, mb2, out_dir, rank, pipeline_microbatches=2
    ))  # fmt: skip
    dense = {"dense_edge": edge_case_batch()}
    log.run("dense", run_model, "tiny", 1, dense, out_dir, rank)
    (out_dir / f"split_rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))

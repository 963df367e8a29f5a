"""Pipeline-parallel layouts of DistributedEngine in one 4-rank gloo launch.

Like ``engine_layouts.py``: the script initialises torch.distributed itself and
every layout re-initialises only Megatron's parallel state. For each layout rank
0 scores a batch that splits into several microbatches and writes
``OUT_DIR/<layout>.npz/.json``; the test compares every PP layout with the
one-stage reference of the same model and microbatch count. Each rank records
which decoder layers (global numbers) and which ends (embedding, output layer,
MTP) its stage holds. Then the failure paths under PP=2 x TP=2: a last-stage
rank that raises, and a last-stage rank that hangs. Check outcomes:
``OUT_DIR/pipeline_rank{r}.json``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist
from engine_common import (
    PP_LENGTHS,
    CheckLog,
    exit_without_teardown,
    expect_injected_failure,
    expect_worker_lost,
    layout_config,
    pp_batch,
    raise_after,
    save_output,
    stall_before,
)

from megascore.api import schema
from megascore.api.errors import WorkerLostError
from megascore.config import EngineConfig
from megascore.engine.layout.microbatch_plan import split_microbatches
from megascore.engine.runtime import DistributedEngine
from megascore.engine.schedule import pipeline as pipeline_module
from megascore.engine.schedule import step as step_module

MICROBATCHES = 3  # the step splits PP_LENGTHS into this many microbatches
# name -> (model, tp, cp, ep, pp[, pad_to_multiple_of]). "moe_pp2_tp2" turns sequence
# parallelism on (MoE at TP > 1): per-sequence pad multiple 2, so its reference packs
# with pad multiple 2 too (pads count in Megatron's MoE aux losses).
MASKED = ("tiny_pp2_tp2", "tiny_pp2_cp2")
"""Layouts that also score the batch with ``logprob_positions`` masked."""
LAYOUTS = {
    "tiny_ref": ("tiny", 1, 1, 1, 1),
    "tiny_pp2": ("tiny", 1, 1, 1, 2),
    "tiny_pp2_tp2": ("tiny", 2, 1, 1, 2),
    "tiny_pp2_cp2": ("tiny", 1, 2, 1, 2),
    "deep_ref": ("tiny-deep", 1, 1, 1, 1),
    "deep_pp4": ("tiny-deep", 1, 1, 1, 4),
    "deep_pp2_tp2": ("tiny-deep", 2, 1, 1, 2),
    "moe_ref": ("tiny-moe", 1, 1, 1, 1),
    "moe_pp2_ep2": ("tiny-moe", 1, 1, 2, 2),
    "moe_ref_pad2": ("tiny-moe", 1, 1, 1, 1, 2),
    "moe_pp2_tp2": ("tiny-moe", 2, 1, 1, 2),
    "moe_ref_mb1": ("tiny-moe", 1, 1, 1, 1),
    "moe_ref_mb4": ("tiny-moe", 1, 1, 1, 1),
}
MOE = {"moe_ref", "moe_pp2_ep2", "moe_ref_pad2", "moe_pp2_tp2", "moe_ref_mb1", "moe_ref_mb4"}
# Layouts whose step runs in another number of microbatches than MICROBATCHES: the
# step-level MoE / MTP metrics do not depend on it.
OTHER_MICROBATCHES = {"moe_ref_mb1": 1, "moe_ref_mb4": 4}


def engine_config(
    model, tp, cp, ep, pp, pad=1, timeout=60.0, microbatches=MICROBATCHES
) -> EngineConfig:
    return layout_config(
        model, tp, cp, ep, pad=pad, timeout=timeout, pipeline_model_parallel_size=pp,
        pipeline_microbatches=microbatches,
        logprob_chunk_tokens=50,  # several chunks per microbatch
    )  # fmt: skip


def stage_contents(engine) -> dict:
    """What this rank's stage holds: global decoder layer numbers and the model's ends."""
    model = engine.loaded.model
    return {
        "pp_rank": engine.pg_collection.pp.rank(),
        "layers": [int(layer.layer_number) for layer in model.decoder.layers],
        "embedding": hasattr(model, "embedding"),
        "output_layer": hasattr(model, "output_layer"),
        "mtp": bool(getattr(model, "mtp_process", False)),
    }


def run_layout(name, spec, rank, out_dir) -> None:
    microbatches = OTHER_MICROBATCHES.get(name, MICROBATCHES)
    engine = DistributedEngine.create(engine_config(*spec, microbatches=microbatches))
    contents = stage_contents(engine)
    (out_dir / f"{name}_stage_rank{rank}.json").write_text(json.dumps(contents))
    if rank != 0:
        engine.worker_loop()
        return
    try:
        info = engine.info()
        assert info.parallel.pipeline_model_parallel_size == spec[4], info.parallel
        if name == "moe_pp2_tp2":
            assert engine.sequence_parallel and engine.pad_multiple == 2, engine.pad_multiple
        out = engine.score(pp_batch(moe=name in MOE))
        save_output(out_dir / name, out, num_parameters=info.num_parameters)
        if name in MASKED:  # the output head only at the loss mask's rows, on the last stage
            masked = dataclasses.replace(pp_batch(), logprob_positions=schema.MASKED)
            save_output(out_dir / f"{name}_masked", engine.score(masked))
    finally:
        engine.shutdown()


def check_last_stage_failure(rank):
    """Rank 3 (last stage, not rank 0's peer) raises after the schedule: every rank
    learns it from the status flags."""
    engine = DistributedEngine.create(engine_config("tiny", 2, 1, 1, 2))
    failing = raise_after(step_module.run_schedule)
    expect_injected_failure(
        engine, rank, step_module, "run_schedule", failing,
        on_rank=3, batch=pp_batch(), match="ranks [3]",
    )  # fmt: skip


def check_hung_last_stage(rank):
    """Rank 2 (rank 0's last-stage peer) stalls mid-step: rank 0 fails within the timeouts."""
    engine = DistributedEngine.create(engine_config("tiny", 2, 1, 1, 2, timeout=3.0))
    if rank == 2:  # 20 s > the result broadcast (3 s) + the status all-reduce (3 x 3 s)
        pipeline_module.score_tokens = stall_before(pipeline_module.score_tokens, 20.0)
    if rank == 0:
        elapsed = expect_worker_lost(lambda: engine.score(pp_batch()), "")
        assert elapsed < 30, f"took {elapsed:.1f} s"
    else:
        try:
            engine.worker_loop()
        except (WorkerLostError, RuntimeError):
            pass


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    ranges, _ = split_microbatches(np.asarray(PP_LENGTHS), 1, MICROBATCHES)
    assert len(ranges) == MICROBATCHES, ranges
    log = CheckLog(out_dir / f"pipeline_rank{rank}.json")
    for name, spec in LAYOUTS.items():
        log.run(f"{name}:run", run_layout, name, spec, rank, out_dir)
    log.run("last_stage_failure", check_last_stage_failure, rank)
    log.run("hung_last_stage", check_hung_last_stage, rank)
    exit_without_teardown()  # the process group is unusable after the hung-rank check


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""A rank that raises inside a step fails the call fast, on every rank (2 gloo ranks, TP=2).

* ``device_error``: rank 1's queued device work fails when the step waits for it
  (``wait_for_device``; on a GPU, an asynchronous CUDA error surfacing at
  ``torch.cuda.synchronize``), after its collectives: the status all-reduce reports
  rank 1 and rank 0's call fails at once, naming it.
* ``raise_in_forward``: rank 1 runs out of memory at the start of its forward, before
  any collective, while rank 0 enters the TP all-reduces: rank 0's collective times
  out after ``collective_timeout_s`` and both ranks agree the step failed; the call
  fails within a few timeouts, not the minutes of a watchdog or the client deadline.

Outcomes: ``OUT_DIR/faults_rank{r}.json`` ({check: "ok" or traceback}) and
``OUT_DIR/faults_timing.json`` (rank 0's seconds per check).
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from engine_common import (
    CheckLog,
    edge_case_batch,
    exit_without_teardown,
    expect_injected_failure,
)

from megascore.config import EngineConfig
from megascore.engine.runtime import DistributedEngine
from megascore.engine.schedule import step as step_module

TIMEOUT_S = 4.0


def _engine() -> DistributedEngine:
    cfg = EngineConfig(model="tiny", tensor_model_parallel_size=2, collective_timeout_s=TIMEOUT_S)
    return DistributedEngine.create(cfg)


def _run(rank: int, target: str, replacement, match: str, timing: dict, name: str) -> None:
    elapsed = expect_injected_failure(
        _engine(), rank, step_module, target, replacement,
        on_rank=1, batch=edge_case_batch(), match=match,
    )  # fmt: skip
    if rank == 0:
        timing[name] = elapsed


def check_device_error(rank: int, timing: dict) -> None:
    def failing(device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    _run(rank, "wait_for_device", failing, "ranks [1]", timing, "device_error")


def check_raise_in_forward(rank: int, timing: dict) -> None:
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    _run(rank, "run_schedule", oom, "step failed on ranks", timing, "raise_in_forward")


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    log = CheckLog(out_dir / f"faults_rank{rank}.json")
    timing: dict[str, float] = {}
    log.run("device_error", check_device_error, rank, timing)
    log.run("raise_in_forward", check_raise_in_forward, rank, timing)
    if rank == 0:
        (out_dir / "faults_timing.json").write_text(json.dumps(timing))
    exit_without_teardown()  # a timed-out gloo pair can leave the default group unusable


if __name__ == "__main__":
    main(Path(sys.argv[1]))

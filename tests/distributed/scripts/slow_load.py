"""Start-up of two gloo ranks where rank 1 finishes loading late, or dies while loading.

Run by tests/distributed/test_load_timeout.py (one process per rank, the launcher's
rendezvous): ``slow_load.py OUT_DIR MODE``. The ranks' step collective timeout is
``COLLECTIVE_TIMEOUT_S`` (the status group's 3 x is ``3 * COLLECTIVE_TIMEOUT_S``);
rank 1's load takes ``LATE_S`` longer than rank 0's.

* ``late``: both ranks build the engine (the post-load agreement waits past the
  status group's timeout, within ``load_timeout_s``) and shut it down.
* ``dead``: rank 1 exits while loading; rank 0's start-up fails at once.

Rank 0 writes ``OUT_DIR/load_MODE.json``: ``{"ok": bool, "error": str, "seconds": float}``
(seconds from its load's end to ``create``'s return or raise).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from megascore.config import EngineConfig
from megascore.engine.runtime import DistributedEngine
from megascore.engine.weights import served_model

COLLECTIVE_TIMEOUT_S = 1.0
LATE_S = 6.0
LOAD_TIMEOUT_S = 120.0


def main(out_dir: Path, mode: str) -> None:
    rank = int(os.environ["RANK"])
    real = served_model.load_served_model  # build_agreeing's load, patched below
    loaded_at = []

    def load(*args, **kwargs):
        if rank == 1:
            time.sleep(LATE_S)
            if mode == "dead":
                os._exit(3)
        out = real(*args, **kwargs)
        loaded_at.append(time.monotonic())
        return out

    served_model.load_served_model = load
    cfg = EngineConfig(
        model="tiny", collective_timeout_s=COLLECTIVE_TIMEOUT_S, load_timeout_s=LOAD_TIMEOUT_S
    )
    result = {"ok": False, "error": ""}
    try:
        engine = DistributedEngine.create(cfg)
        result["ok"] = True
        if rank != 0:
            engine.worker_loop()
        else:
            engine.shutdown()
    except Exception:  # noqa: BLE001 - recorded for the test
        result["error"] = traceback.format_exc()
    result["seconds"] = time.monotonic() - loaded_at[0] if loaded_at else -1.0
    if rank == 0:
        (out_dir / f"load_{mode}.json").write_text(json.dumps(result))
    if dist.is_initialized() and not result["ok"]:
        os._exit(1)  # after a lost rank the default group cannot be torn down cleanly


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])

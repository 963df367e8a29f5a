"""Engine factory for ``megascore serve`` process tests (``MEGASCORE_ENGINE_FACTORY``).

Ranks coordinate through files in ``$MEGASCORE_FAKE_DIR`` instead of
collectives: rank 0's ``shutdown()`` writes ``SHUTDOWN`` (the broadcast),
workers leave ``worker_loop()`` when they see it; a worker told to die
(``kill<rank>`` file) exits 3 and rank 0's next step raises WorkerLostError (as
it does whenever a ``lose`` file exists).

Model loading: with ``MEGASCORE_FAKE_HOLD_LOAD=1`` every rank's build waits
(``loading<rank>`` written) until a ``release`` file exists, as a long
collective model load would; a worker gives up when rank 0 is gone, as its
collectives would fail. ``MEGASCORE_FAKE_LOAD_ERROR=reason`` then makes every
rank's build raise ``CheckpointError(reason)``. Rank 0 records the thread that
built its engine (``built_on``) and the one running its steps (``step_thread``).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from megascore.api.errors import CheckpointError, WorkerLostError
from megascore_server.procfs import alive
from tests.service.fake_engine import FakeEngine


class Rank0Engine(FakeEngine):
    def __init__(self, directory: Path, world_size: int):
        super().__init__()
        self.directory = directory
        self.world_size = world_size

    def score(self, batch):
        (self.directory / "step_thread").write_text(threading.current_thread().name)
        if (self.directory / "lose").exists():
            raise WorkerLostError("rank 3 is gone")
        for rank in range(1, self.world_size):
            if (self.directory / f"exited{rank}").exists():
                raise WorkerLostError(f"rank {rank} is gone")
        return super().score(batch)

    def shutdown(self) -> None:
        (self.directory / "SHUTDOWN").write_text("1")


class WorkerEngine:
    def __init__(self, directory: Path, rank: int):
        self.directory = directory
        self.rank = rank

    def worker_loop(self) -> None:
        while not (self.directory / "SHUTDOWN").exists():
            if (self.directory / f"kill{self.rank}").exists():
                (self.directory / f"exited{self.rank}").write_text("3")
                os._exit(3)
            time.sleep(0.02)
        (self.directory / f"clean{self.rank}").write_text("0")


def _hold_load(directory: Path, rank: int) -> None:
    """Waits for the ``release`` file, as every rank inside a long collective load."""
    (directory / f"loading{rank}").write_text("1")
    while not (directory / "release").exists():
        pid0 = directory / "pid0"
        if rank != 0 and pid0.exists() and not alive(int(pid0.read_text())):
            raise WorkerLostError("rank 0 is gone during the model build")
        time.sleep(0.02)


def create(engine_config):
    directory = Path(os.environ["MEGASCORE_FAKE_DIR"])
    rank = int(os.environ["RANK"])
    tmp = directory / f".pid{rank}"
    tmp.write_text(str(os.getpid()))
    tmp.rename(directory / f"pid{rank}")  # atomic: tests never read a partial file
    if os.environ.get("MEGASCORE_FAKE_HOLD_LOAD"):
        _hold_load(directory, rank)
    if os.environ.get("MEGASCORE_FAKE_LOAD_ERROR"):
        raise CheckpointError(os.environ["MEGASCORE_FAKE_LOAD_ERROR"])
    if rank == 0:
        (directory / "built_on").write_text(threading.current_thread().name)
        return Rank0Engine(directory, int(os.environ["WORLD_SIZE"]))
    return WorkerEngine(directory, rank)

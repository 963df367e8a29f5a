"""Engine factory for ``megascore serve`` process tests (``MEGASCORE_ENGINE_FACTORY``).

Ranks coordinate through files in ``$MEGASCORE_FAKE_DIR`` instead of
collectives: rank 0's ``shutdown()`` writes ``SHUTDOWN`` (the broadcast),
workers leave ``worker_loop()`` when they see it; a worker told to die
(``kill<rank>`` file) exits 3 and rank 0's next step raises WorkerLostError (as
it does whenever a ``lose`` file exists).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from megascore.errors import WorkerLostError
from tests.service.fake_engine import FakeEngine


class Rank0Engine(FakeEngine):
    def __init__(self, directory: Path, world_size: int):
        super().__init__()
        self.directory = directory
        self.world_size = world_size

    def score(self, batch):
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


def create(engine_config):
    directory = Path(os.environ["MEGASCORE_FAKE_DIR"])
    rank = int(os.environ["RANK"])
    tmp = directory / f".pid{rank}"
    tmp.write_text(str(os.getpid()))
    tmp.rename(directory / f"pid{rank}")  # atomic: tests never read a partial file
    if rank == 0:
        return Rank0Engine(directory, int(os.environ["WORLD_SIZE"]))
    return WorkerEngine(directory, rank)

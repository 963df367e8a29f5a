"""Local multi-rank launcher for ``megascore serve --nproc N`` (torchrun-equivalent).

Starts N processes of ``python -m megascore_server.main`` with the rendezvous
variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR; MASTER_PORT as below) and the already-resolved config,
then supervises them. A plain subprocess supervisor rather than torch's
``elastic_launch`` because shutdown must be driven by rank 0 (torch's agent
signals every worker at once and needs torch imported in this process):

* SIGTERM / SIGINT here -> SIGTERM to rank 0, which drains and broadcasts
  SHUTDOWN; workers ignore signals and leave with that broadcast. A second
  signal kills every rank.
* A rank exiting non-zero (lost rank) -> the others get ``failure_grace_s`` to
  exit (rank 0 notices the loss, fails its calls and exits 1), then SIGKILL; exit code
  non-zero. Once rank 0 has failed, the workers left get ``orphan_grace_s`` only: no
  SHUTDOWN can reach them and they hold nothing to save (a hung or stopped one would
  otherwise hold the replica's end for the whole ``failure_grace_s``).
* Children die with this process (``PR_SET_PDEATHSIG``), so no orphan survives
  even a SIGKILL of the launcher.
* Rank 0's TCPStore binds a port of the kernel's choice and rank 0 writes it to a
  file the other ranks wait for (``MASTER_PORT_FILE_ENV``,
  :mod:`megascore.engine.ranks.rendezvous`). A port picked here could not be held while
  rank 0 imports torch (seconds), and another process could take it meanwhile: the
  other ranks would then knock on that process's port.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from megascore.config import MASTER_PORT_FILE_ENV
from megascore_server.config import ReplicaConfig

logger = logging.getLogger(__name__)

RESOLVED_CONFIG_ENV = "_MEGASCORE_RESOLVED_CONFIG"
LAUNCHED_ENV = "_MEGASCORE_LAUNCHED"
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def rank_env(config: ReplicaConfig, rank: int, port_file: str) -> dict[str, str]:
    """Environment of local rank ``rank``; rank 0 writes its store's port to ``port_file``."""
    n = config.nproc
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(n),
        LOCAL_WORLD_SIZE=str(n),
        MASTER_ADDR="127.0.0.1",
    )
    env.pop("MASTER_PORT", None)  # rank 0 chooses it (module docstring)
    env[MASTER_PORT_FILE_ENV] = port_file
    env[RESOLVED_CONFIG_ENV] = json.dumps(config.to_dict())
    env[LAUNCHED_ENV] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N ranks must not oversubscribe
    return env


class LocalLauncher:
    """Starts and supervises the N local ranks of one replica.

    Args:
        config: the resolved configuration (passed to every rank verbatim).
        failure_grace_s: after a rank failed, time the others get before SIGKILL.
        orphan_grace_s: after rank 0 failed, time the workers left get before SIGKILL.
    """

    def __init__(
        self, config: ReplicaConfig, *, failure_grace_s: float = 15.0, orphan_grace_s: float = 2.0
    ):
        self.config = config
        self.failure_grace_s = failure_grace_s
        self.orphan_grace_s = orphan_grace_s
        self._orphaned = False
        self.procs: list[subprocess.Popen] = []
        self._signals = 0
        self._kill_at: float | None = None

    def _on_signal(self, signum: int, frame) -> None:
        self._signals += 1
        if self._signals == 1:
            logger.info("%s: asking rank 0 to drain", signal.Signals(signum).name)
            self._send(0, signal.SIGTERM)
            self._deadline(self.config.server.grace_s + self.config.engine.collective_timeout_s)
        else:
            logger.warning("second signal: killing every rank")
            self._deadline(0.0)

    def _deadline(self, seconds: float) -> None:
        at = time.monotonic() + seconds
        self._kill_at = at if self._kill_at is None else min(self._kill_at, at)

    def _send(self, rank: int, signum: int) -> None:
        proc = self.procs[rank]
        if proc.poll() is None:
            proc.send_signal(signum)

    def run(self) -> int:
        """Launches the ranks and waits for them; returns the launcher's exit code."""
        n = self.config.nproc
        rendezvous = tempfile.mkdtemp(prefix="megascore-rendezvous-")
        port_file = os.path.join(rendezvous, "master_port")
        logger.info("launching %d local ranks", n)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for rank in range(n):
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "megascore_server.main"],
                        env=rank_env(self.config, rank, port_file),
                        preexec_fn=_die_with_parent,
                    )
                )
            return self._supervise()
        finally:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            for s, handler in previous.items():
                signal.signal(s, handler)
            shutil.rmtree(rendezvous, ignore_errors=True)

    def _supervise(self) -> int:
        failed: int | None = None
        while True:
            codes = [p.poll() for p in self.procs]
            for rank, code in enumerate(codes):
                if code not in (None, 0) and failed is None:
                    failed = code
                    logger.error("rank %d exited with code %d: stopping the replica", rank, code)
                    self._send(0, signal.SIGTERM)
                    self._deadline(self.failure_grace_s)
            if all(code is not None for code in codes):
                break
            if codes[0] not in (None, 0) and not self._orphaned:
                self._orphaned = True
                self._deadline(self.orphan_grace_s)
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                logger.error("ranks did not exit in time: killing them")
                for proc in self.procs:
                    if proc.poll() is None:
                        proc.kill()
                failed = failed or 1
                self._kill_at = None  # SIGKILL once, then wait for the exits (no log flood)
            time.sleep(0.05)
        codes = [p.returncode for p in self.procs]
        logger.info("ranks exited with codes %s", codes)
        if failed is not None:
            return failed if failed > 0 else 1
        return 0

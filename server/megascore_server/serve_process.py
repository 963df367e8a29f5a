"""A ``megascore serve`` subprocess, started, watched and stopped from its parent.

:class:`ServeProcess` starts ``megascore serve`` (the console script, or ``torchrun -m
megascore_server.main``) in its own session on 127.0.0.1 and a free port
(:func:`megascore_server.ports.pick_port`), records the health states it passes
through until SERVING, finds its ranks, CPU time and memory through ``/proc``
(:mod:`megascore_server.procfs`) and always tears down what it started: SIGCONT and
SIGKILL to its own process group and the pids it saw, never a kill by name.

The tests (``tests/e2e/serve.py``), the benches and the scripts start their servers
with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from megascore.api.wire import encode_array
from megascore.v1 import scoring_pb2 as pb
from megascore.v1 import scoring_pb2_grpc as pb_grpc
from megascore_server import procfs
from megascore_server.ports import pick_port

MEGASCORE = Path(sys.executable).with_name("megascore")
"""The console script of this interpreter's environment."""
START_TIMEOUT_S = 240.0  # torch + megatron import on 2 busy cores
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
CPU_ONE_THREAD = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
"""``env`` of a CPU server with one intra-op thread per rank, the GPUs hidden."""
# The parent's own role, never the child's: torch.distributed rank variables, and the
# engine factory hook (a child gets one only through ``env``).
_PARENT_ONLY = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MEGASCORE_ENGINE_FACTORY",
)


class ServeError(RuntimeError):
    """The server exited early, never became SERVING, or did not exit in time."""


def serve_command() -> list[str]:
    """``megascore``: the console script, or the CLI module where it is not installed."""
    if MEGASCORE.exists():
        return [str(MEGASCORE)]
    return [sys.executable, "-m", "megascore_client.cli"]


def _command(flags: list[str], torchrun_nproc: int | None) -> list[str]:
    if torchrun_nproc is None:
        return [*serve_command(), "serve", *flags]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={torchrun_nproc}",
        "--standalone",  # its store binds a port of the kernel's choice
        "--max-restarts=0",
        "-m",
        "megascore_server.main",
        *flags,
    ]


def _environment(env: Mapping[str, str | None] | None) -> dict[str, str]:
    """This process's environment without :data:`_PARENT_ONLY`, then ``env`` (None: unset)."""
    environ = {k: v for k, v in os.environ.items() if k not in _PARENT_ONLY}
    environ["PYTHONUNBUFFERED"] = "1"
    for key, value in (env or {}).items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    return environ


class ServeProcess:
    """``megascore serve`` as a subprocess in its own session.

    Args:
        log_path: file receiving the server's stdout / stderr.
        args: extra ``serve`` flags (``--port`` and ``--host`` are added).
        torchrun_nproc: start under ``python -m torch.distributed.run`` with this many
            ranks per node instead of the console script.
        metrics: also expose the Prometheus endpoint on a free port.
        env: environment changes over this process's own (a None value unsets the
            variable); e.g. :data:`CPU_ONE_THREAD`.
        credentials: TLS credentials of the helper's own channel (health polling);
            None for a plaintext server.
        port: the port to serve on (e.g. ``pick_port()``, to restart a server on the
            same address); None = a free port.
        cwd: working directory of the server (None: this process's).
        poll_s: seconds between the start-up health checks.
    """

    def __init__(
        self,
        log_path: Path,
        *args: str,
        torchrun_nproc: int | None = None,
        metrics: bool = False,
        env: Mapping[str, str | None] | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        port: int | None = None,
        cwd: Path | None = None,
        poll_s: float = 0.1,
    ):
        self.log_path = Path(log_path)
        self.port = pick_port() if port is None else port
        self.metrics_port = pick_port() if metrics else None
        self.target = f"127.0.0.1:{self.port}"
        self.health_seen: list[str] = []
        self.startup_probe: tuple[grpc.StatusCode, str] | None = None
        self.serving_s: float | None = None  # spawn -> first SERVING answer, seconds
        flags = ["--host", "127.0.0.1", "--port", str(self.port), *args]
        if self.metrics_port:
            flags += ["--metrics-port", str(self.metrics_port)]
        self.cmd = _command(flags, torchrun_nproc)
        self._poll_s = poll_s
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        self._started = time.perf_counter()
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=cwd,
            env=_environment(env),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.pid = self.proc.pid
        if credentials is None:
            self._channel = grpc.insecure_channel(self.target)
        else:
            self._channel = grpc.secure_channel(self.target, credentials)
        self.known_pids: set[int] = {self.pid}
        self._closing = False
        self._serving = threading.Event()
        self._monitor = threading.Thread(target=self._monitor_startup, daemon=True)
        self._monitor.start()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- state ----------------------------------------------------------------------------

    def output(self, tail: int = 12000) -> str:
        """The last ``tail`` characters of the server's log."""
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except FileNotFoundError:
            return ""

    def running(self) -> bool:
        return self.proc.poll() is None

    def stub(self) -> pb_grpc.ScorerStub:
        return pb_grpc.ScorerStub(self._channel)

    def health(self, service: str = "", timeout: float = 2.0) -> int:
        """One Health/Check on the helper's own channel (TLS if given); raises grpc.RpcError."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status

    def _note(self, state: str) -> None:
        if not self.health_seen or self.health_seen[-1] != state:
            self.health_seen.append(state)

    def _probe_score(self) -> tuple[grpc.StatusCode, str]:
        """What a Score call gets before SERVING (code, details)."""
        request = pb.ScoreRequest(
            token_ids=encode_array(np.array([1, 2, 3], dtype=np.int64)),
            lengths=encode_array(np.array([3], dtype=np.int64)),
        )
        try:
            self.stub().Score(request, timeout=5)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""

    def _monitor_startup(self) -> None:
        """Thread: polls Health/Check from the start until SERVING, recording each state.

        States: "unreachable" (no answer), "NOT_SERVING", "SERVING", or another status
        code name (e.g. DEADLINE_EXCEEDED while rank 0's imports hold the GIL). The first
        NOT_SERVING also records what a Score call gets then (:attr:`startup_probe`).
        """
        while self.running() and not self._closing:  # wait_serving() bounds the wait
            try:
                status = self.health(timeout=2.0)
                state = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as exc:
                code = exc.code()
                state = "unreachable" if code is grpc.StatusCode.UNAVAILABLE else code.name
            except ValueError:  # the channel was closed meanwhile
                return
            if state == "SERVING":
                self.serving_s = time.perf_counter() - self._started
            self._note(state)
            if state == "NOT_SERVING" and self.startup_probe is None:
                self.startup_probe = self._probe_score()
            if state == "SERVING":
                self._serving.set()
                self.known_pids.update(procfs.descendants(self.pid))
                return
            time.sleep(self._poll_s)

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> None:
        """Waits until the start-up monitor saw SERVING.

        Raises:
            ServeError: the server exited first, or is not SERVING after ``timeout`` s
                (with the log's tail).
        """
        end = time.monotonic() + timeout
        while not self._serving.wait(0.2):
            if not self.running():
                raise ServeError(f"serve exited early ({self.proc.returncode}):\n{self.output()}")
            if time.monotonic() >= end or not self._monitor.is_alive():
                raise ServeError(f"never SERVING (seen {self.health_seen}):\n{self.output()}")

    def rank_pids(self) -> dict[int, int]:
        """rank -> pid of the live ranks (the server process itself when it is rank 0)."""
        ranks = {}
        for pid in [self.pid, *procfs.descendants(self.pid)]:
            rank = procfs.env_of(pid).get("RANK")
            if rank is not None and procfs.alive(pid):
                ranks[int(rank)] = pid
        if not ranks and procfs.alive(self.pid):
            ranks[0] = self.pid  # single process: RANK is set inside it, not in its environ
        self.known_pids.update(ranks.values())
        return ranks

    def tree(self) -> list[int]:
        """The server process and its live descendants."""
        pids = [self.pid, *procfs.descendants(self.pid)] if procfs.alive(self.pid) else []
        self.known_pids.update(pids)
        return pids

    def total_rss_kb(self) -> int:
        """VmRSS of the server process and its descendants together, KiB."""
        return sum(procfs.rss_kb(pid) for pid in self.tree())

    def cpu_seconds(self) -> float:
        """User + system CPU seconds so far of the server process and its live descendants."""
        return procfs.cpu_seconds(*self.tree())

    @property
    def metrics_url(self) -> str:
        assert self.metrics_port, "server started without metrics"
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def metrics_text(self, timeout: float = 10.0) -> str:
        """The Prometheus endpoint's text (the server must run with ``metrics=True``)."""
        with urllib.request.urlopen(self.metrics_url, timeout=timeout) as response:  # noqa: S310
            return response.read().decode()

    # ---- shutdown -------------------------------------------------------------------------

    def wait(self, timeout: float) -> int:
        """The exit code; raises :class:`ServeError` when still running after ``timeout`` s."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise ServeError(f"serve did not exit in {timeout} s:\n{self.output()}") from None

    def leftovers(self, timeout: float = 15.0) -> list[int]:
        """Processes of this server still alive ``timeout`` s after it exited.

        Checks every pid seen so far (ranks, launcher children) and the process group.
        """
        return procfs.wait_gone(set(self.known_pids) | set(procfs.group_members(self.pid)), timeout)

    def terminate(self, timeout: float = 90.0) -> int:
        """SIGTERM to the server process; returns its exit code."""
        self.tree()
        if self.running():
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def end_cleanly(self, timeout: float = 120.0) -> tuple[int, list[str]]:
        """SIGTERM (:meth:`terminate`); returns the exit code and what a clean end must
        not show: a traceback anywhere in the log, a non-zero exit."""
        problems = []
        if "Traceback (most recent call last)" in self.output(tail=10**9):
            problems.append(f"traceback in the server log {self.log_path}")
        code = self.terminate(timeout)
        if code != 0:
            problems.append(f"server exited {code} on SIGTERM")
        return code, problems

    def stop(self, grace: float = 30.0) -> int:
        """SIGTERM, then :meth:`close` (SIGKILL to what is left) after ``grace`` s; exit code."""
        try:
            with contextlib.suppress(ServeError):
                self.terminate(grace)
        finally:
            self.close()
        return self.proc.returncode

    def _kill_all(self, pids: set[int], sig: int) -> None:
        for pid in pids:
            if procfs.alive(pid) and pid != os.getpid():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)

    def close(self) -> None:
        """Kills whatever is left of this server (its process group) and closes files."""
        self._closing = True
        self._monitor.join(5)
        self._channel.close()
        pids = set(self.known_pids) | set(procfs.group_members(self.pid))
        if self.running():
            pids.update(procfs.descendants(self.pid))
        self._kill_all(pids, signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        self._kill_all(pids, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self._log.close()

"""A real ``megascore serve`` subprocess for end-to-end tests, and /proc helpers.

:class:`ServeProcess` starts ``megascore serve`` (the console script, or
``torchrun -m megascore_server.main``) in its own session on 127.0.0.1 and a free
port, waits for SERVING while recording the health states it passes through, finds
its ranks through ``/proc`` and always tears everything it started down: SIGCONT and
SIGKILL to its own process group, never a kill by name.

:class:`SharedServers` keeps one server per configuration for the whole pytest
session: ``tests/e2e`` and ``tests/reliability`` use the same subprocesses (fixtures in
:mod:`tests.e2e.fixtures`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from megascore.api.wire import encode_array
from megascore.v1 import scoring_pb2 as pb
from megascore.v1 import scoring_pb2_grpc as pb_grpc
from megascore_server.ports import pick_port

ROOT = Path(__file__).resolve().parents[2]
MEGASCORE = Path(sys.executable).with_name("megascore")
START_TIMEOUT_S = 240.0  # torch + megatron import on 2 busy cores
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# ---------------------------------------------------------------------------- /proc


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, ppid, pgid)`` of ``pid``, or None when it does not exist."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        fields = raw.rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[2])
    except (OSError, IndexError, ValueError):  # gone, or caught mid-exit with a short read
        return None


def alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def children(pid: int) -> list[int]:
    """Live (non-zombie) direct children of ``pid``."""
    out = []
    for p in all_pids():
        stat = _stat(p)
        if stat is not None and stat[1] == pid and stat[0] != "Z":
            out.append(p)
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, grandchildren ...)."""
    found, frontier = [], [pid]
    while frontier:
        kids = [c for p in frontier for c in children(p)]
        found += kids
        frontier = kids
    return found


def group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid``."""
    out = []
    for p in all_pids():
        stat = _stat(p)
        if stat is not None and stat[2] == pgid and stat[0] != "Z":
            out.append(p)
    return out


def env_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def rss_kb(pid: int) -> int:
    """VmRSS of ``pid`` in KiB (0 when gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def wait_gone(pids, timeout: float = 10.0) -> list[int]:
    """Waits until none of ``pids`` is alive; returns those still alive after ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() >= end:
            return left
        time.sleep(0.1)


# ---------------------------------------------------------------------------- server


class ServeProcess:
    """``megascore serve`` as a subprocess in its own session.

    Args:
        log_path: file receiving the server's stdout / stderr.
        args: extra ``serve`` flags (``--port`` and ``--host`` are added).
        torchrun_nproc: start under ``python -m torch.distributed.run`` with this many
            ranks per node instead of the console script.
        metrics: also expose the Prometheus endpoint on a free port.
        env: extra environment variables.
        credentials: TLS credentials of the helper's own channel (health polling);
            None for a plaintext server.
        port: the port to serve on (e.g. ``megascore_server.ports.pick_port()``, to
            restart a server on the same address); None = a free port.
    """

    def __init__(
        self,
        log_path: Path,
        *args: str,
        torchrun_nproc: int | None = None,
        metrics: bool = False,
        env: dict[str, str] | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        port: int | None = None,
    ):
        self.log_path = Path(log_path)
        self.port = pick_port() if port is None else port
        self.metrics_port = pick_port() if metrics else None
        self.target = f"127.0.0.1:{self.port}"
        self.health_seen: list[str] = []
        self.startup_probe: tuple[grpc.StatusCode, str] | None = None
        flags = ["--host", "127.0.0.1", "--port", str(self.port), *args]
        if self.metrics_port:
            flags += ["--metrics-port", str(self.metrics_port)]
        if torchrun_nproc is None:
            cmd = [str(MEGASCORE), "serve", *flags]
        else:
            cmd = [
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
        environ = {k: v for k, v in os.environ.items() if k not in _RANK_VARS}
        environ.update(
            OMP_NUM_THREADS="1",
            CUDA_VISIBLE_DEVICES="",
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")])),
        )
        environ.pop("MEGASCORE_ENGINE_FACTORY", None)
        environ.update(env or {})
        self.cmd = cmd
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=environ,
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

    # ---- state ----------------------------------------------------------------------------

    def output(self, tail: int = 12000) -> str:
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
        code name (e.g. DEADLINE_EXCEEDED while rank 0's imports hold the GIL).
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
            self._note(state)
            if state == "NOT_SERVING" and self.startup_probe is None:
                self.startup_probe = self._probe_score()
            if state == "SERVING":
                self._serving.set()
                self.known_pids.update(descendants(self.pid))
                return
            time.sleep(0.1)

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> None:
        """Waits until the start-up monitor saw SERVING (fails if the server exits first)."""
        end = time.monotonic() + timeout
        while not self._serving.wait(0.2):
            if not self.running():
                raise AssertionError(
                    f"serve exited early ({self.proc.returncode}):\n{self.output()}"
                )
            if time.monotonic() >= end or not self._monitor.is_alive():
                raise AssertionError(f"never SERVING (seen {self.health_seen}):\n{self.output()}")

    def rank_pids(self) -> dict[int, int]:
        """rank -> pid of the live ranks (the server process itself when it is rank 0)."""
        ranks = {}
        for pid in [self.pid, *descendants(self.pid)]:
            rank = env_of(pid).get("RANK")
            if rank is not None and alive(pid):
                ranks[int(rank)] = pid
        if not ranks and alive(self.pid):
            ranks[0] = self.pid  # single process: RANK is set inside it, not in its environ
        self.known_pids.update(ranks.values())
        return ranks

    def tree(self) -> list[int]:
        """The server process and its live descendants."""
        pids = [self.pid, *descendants(self.pid)] if alive(self.pid) else []
        self.known_pids.update(pids)
        return pids

    def total_rss_kb(self) -> int:
        return sum(rss_kb(pid) for pid in self.tree())

    def metrics_text(self, timeout: float = 10.0) -> str:
        assert self.metrics_port, "server started without metrics"
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310
            return response.read().decode()

    # ---- shutdown -------------------------------------------------------------------------

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"serve did not exit in {timeout} s:\n{self.output()}") from None

    def leftovers(self, timeout: float = 15.0) -> list[int]:
        """Processes of this server still alive ``timeout`` s after it exited.

        Checks every pid seen so far (ranks, launcher children) and the process group.
        """
        return wait_gone(set(self.known_pids) | set(group_members(self.pid)), timeout)

    def terminate(self, timeout: float = 90.0) -> int:
        """SIGTERM to the server process; returns its exit code."""
        self.tree()
        if self.running():
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def close(self) -> None:
        """Kills whatever is left of this server (its process group) and closes files."""
        self._closing = True
        self._monitor.join(5)
        self._channel.close()
        pids = set(self.known_pids) | set(group_members(self.pid))
        if self.running():
            pids.update(descendants(self.pid))
        for pid in pids:
            if alive(pid) and pid != os.getpid():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in pids:
            if alive(pid) and pid != os.getpid():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self._log.close()


class SharedServers:
    """One :class:`ServeProcess` per named configuration, shared by every test of a session.

    ``acquire`` starts the server on first use, together with the other shared
    servers the session will need (their start-ups overlap: a ``--nproc 1`` server
    keeps only one core busy), and waits until it is SERVING. ``release`` stops a
    server (SIGTERM, which must exit 0 and leave no process) when its last user
    releases it; servers started but never acquired are stopped with the last one.
    Each session fixture (:func:`shared_server_fixture`) acquires once. Whatever
    survives a crashed session is killed at interpreter exit.
    """

    CONFIGS: dict[str, dict] = {
        "tp1": {"args": ("--model", "tiny", "--grace-s", "10"), "metrics": True},
        "tp2": {
            "args": (
                "--model",
                "tiny",
                "--nproc",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--grace-s",
                "10",
            ),
            "metrics": True,
        },
    }

    def __init__(self):
        self._servers: dict[str, ServeProcess] = {}
        self._users: dict[str, int] = {}
        self._ready: set[str] = set()
        self.exit_codes: dict[str, int | None] = {}
        atexit.register(self.kill_all)

    def _start(self, name: str, log_dir: Path) -> None:
        spec = self.CONFIGS[name]
        self._servers[name] = ServeProcess(
            log_dir / f"shared-{name}.log", *spec["args"], metrics=spec["metrics"]
        )
        self._users[name] = 0

    def acquire(self, name: str, log_dir: Path, prestart=()) -> ServeProcess:
        """The SERVING server ``name``; also starts (without waiting) those in ``prestart``."""
        for other in [name, *sorted(set(prestart) - {name})]:
            if other not in self._servers:
                self._start(other, log_dir)
        server = self._servers[name]
        if name not in self._ready:
            try:
                server.wait_serving()
            except BaseException:
                self._servers.pop(name)
                self._users.pop(name)
                server.close()
                raise
            self._ready.add(name)
        self._users[name] += 1
        return server

    def release(self, name: str) -> None:
        """Drops one user; the last user of all stops every shared server."""
        self._users[name] -= 1
        if any(self._users.values()):
            return
        problems = []
        for other in sorted(self._servers):
            server = self._servers.pop(other)
            self._users.pop(other)
            self._ready.discard(other)
            try:
                code = server.terminate(timeout=60) if server.running() else server.proc.returncode
                self.exit_codes[other] = code
                left = server.leftovers()
            finally:
                server.close()
            if code != 0:
                problems.append(f"shared server {other} exited {code}:\n{server.output()}")
            if left:
                problems.append(f"shared server {other} left processes {left}")
        assert not problems, "\n".join(problems)

    def kill_all(self) -> None:
        """Kills every shared server still running (interpreter exit after a crash)."""
        for server in list(self._servers.values()):
            server.close()
        self._servers.clear()


SHARED = SharedServers()


def shared_server_fixture(name: str):
    """A session fixture yielding the shared server ``name`` (see :class:`SharedServers`).

    :mod:`tests.e2e.fixtures` defines the fixtures from this factory; the first one
    used also starts the other shared servers that the session's tests use.
    """

    @pytest.fixture(scope="session")
    def fixture(request, tmp_path_factory):
        wanted = {
            other
            for item in request.session.items
            for other in SharedServers.CONFIGS
            if f"shared_{other}" in getattr(item, "fixturenames", ())
        }
        server = SHARED.acquire(name, tmp_path_factory.mktemp("shared"), prestart=wanted)
        yield server
        SHARED.release(name)

    return fixture


def running(server: ServeProcess) -> ServeProcess:
    """Fails the calling test at once when a shared server died in an earlier test."""
    assert server.running(), f"shared server exited {server.proc.returncode}:\n{server.output()}"
    return server


def own_servers(log_dir: Path):
    """Generator behind the ``serve`` fixtures: yields ``start(*args, **kw)``, kills all after."""
    started: list[ServeProcess] = []

    def start(*args: str, **kw) -> ServeProcess:
        server = ServeProcess(log_dir / f"serve{len(started)}.log", *args, **kw)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.close()


def assert_not_serving(server: ServeProcess) -> None:
    """Health is not SERVING: NOT_SERVING, or the server is stopping / gone."""
    try:
        status = server.health(timeout=10)
    except grpc.RpcError as exc:  # refused (gone) or cancelled by the stopping server
        assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), exc
    else:
        assert status != SERVING


def run_example(script: str, *args: str, timeout: float = 240) -> tuple[list[dict], float]:
    """Runs ``examples/<script> --launch --json *args`` (it starts its own servers) and
    checks it exits 0; returns its per-step JSON lines (``{"step": ...}``) and the
    seconds it took."""
    import json

    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--launch", "--json", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    return [json.loads(line) for line in lines if line.startswith('{"step"')], elapsed

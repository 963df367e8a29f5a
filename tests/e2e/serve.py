"""The real ``megascore serve`` subprocesses of the end-to-end tests.

:class:`ServeProcess` is :class:`megascore_server.serve_process.ServeProcess` with the
tests' environment: one intra-op thread per rank, no GPU, the checkout on
``PYTHONPATH`` (engine factories of ``tests.*``) and as the working directory. The
tests read ``/proc`` with :mod:`megascore_server.procfs`.

:class:`SharedServers` keeps one server per configuration for the whole pytest
session: ``tests/e2e`` and ``tests/reliability`` use the same subprocesses (fixtures in
:mod:`tests.e2e.fixtures`).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from megascore_server import serve_process
from megascore_server.serve_process import SERVING

ROOT = Path(__file__).resolve().parents[2]


class ServeProcess(serve_process.ServeProcess):
    """The product harness, started as every test starts it (see the module docstring).

    ``env`` entries override the tests' own (``MEGASCORE_ENGINE_FACTORY`` for a fake
    engine, ``CUDA_VISIBLE_DEVICES`` ...); the other arguments are the product's.
    """

    def __init__(self, log_path: Path, *args: str, env: dict | None = None, **kw):
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        environ = {**serve_process.CPU_ONE_THREAD, "PYTHONPATH": path, **(env or {})}
        super().__init__(log_path, *args, env=environ, cwd=ROOT, **kw)


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
        "moe1": {"args": ("--model", "tiny-moe", "--grace-s", "10"), "metrics": True},
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

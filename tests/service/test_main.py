"""``megascore serve`` as a process: local launcher, signals, lost rank, no orphans.

The engine comes from ``tests.service.dist_fake`` through MEGASCORE_ENGINE_FACTORY.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from megascore.v1 import scoring_pb2_grpc as pb_grpc
from tests.service.harness import Req, check_response, free_port

ROOT = Path(__file__).resolve().parents[2]
SERVE = "import sys; from megascore_server.main import main; sys.exit(main(sys.argv[1:]))"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


class Serve:
    """``megascore serve`` in a subprocess, killed with its ranks at teardown."""

    def __init__(self, tmp_path: Path, *args: str, env: dict | None = None):
        self.dir = tmp_path
        self.port = free_port()
        environ = dict(os.environ)
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
            environ.pop(key, None)
        environ.update(
            PYTHONPATH=str(ROOT),
            MEGASCORE_ENGINE_FACTORY="tests.service.dist_fake:create",
            MEGASCORE_FAKE_DIR=str(tmp_path),
            **(env or {}),
        )
        self.log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, "--port", str(self.port), "--grace-s", "5", *args],
            env=environ,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.ScorerStub(self.channel)

    def output(self) -> str:
        return (self.dir / "serve.log").read_text()

    def wait_serving(self, timeout: float = 60) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"serve exited early:\n{self.output()}"
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"never SERVING:\n{self.output()}")

    def rank_pids(self, n: int, timeout: float = 30) -> list[int]:
        files = [self.dir / f"pid{r}" for r in range(n)]
        end = time.monotonic() + timeout
        while not all(f.exists() and f.read_text() for f in files):
            assert time.monotonic() < end, f"ranks did not start:\n{self.output()}"
            time.sleep(0.05)
        return [int(f.read_text()) for f in files]

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"serve did not exit:\n{self.output()}") from None

    def close(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture
def serve(tmp_path):
    started = []

    def start(*args, **kw):
        s = Serve(tmp_path, *args, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


REQ = Req([[1, 2, 3], [4, 5]], request_id="proc")


def test_nproc2_ctrl_c_drains_and_exits_zero(serve, tmp_path):
    s = serve("--nproc", "2")
    s.wait_serving()
    check_response(s.stub.Score(REQ.proto(), timeout=10), REQ)
    pids = s.rank_pids(2)
    assert s.proc.pid not in pids  # the launcher is not a rank
    os.killpg(s.proc.pid, signal.SIGINT)  # Ctrl-C: every process of the group gets it
    assert s.wait() == 0, s.output()
    assert (tmp_path / "SHUTDOWN").exists() and (tmp_path / "clean1").exists()
    assert not any(alive(pid) for pid in pids)
    assert s.output().count("resolved config") == 1


def test_worker_death_stops_the_replica_nonzero(serve, tmp_path):
    s = serve("--nproc", "2")
    s.wait_serving()
    pids = s.rank_pids(2)
    (tmp_path / "kill1").write_text("")
    assert s.wait() == 3, s.output()  # the failed rank's exit code
    assert not any(alive(pid) for pid in pids)
    with pytest.raises(grpc.RpcError) as info:
        s.stub.Score(REQ.proto(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_rank0_sees_lost_rank_and_exits_one(serve, tmp_path):
    s = serve()  # nproc 1: rank 0 in the process itself
    s.wait_serving()
    assert s.rank_pids(1) == [s.proc.pid]
    check_response(s.stub.Score(REQ.proto(), timeout=10), REQ)
    (tmp_path / "lose").write_text("")
    with pytest.raises(grpc.RpcError) as info:
        s.stub.Score(REQ.proto(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "rank 3 is gone" in info.value.details()
    assert s.wait() == 1, s.output()


def test_launcher_sigkill_leaves_no_orphans(serve):
    s = serve("--nproc", "2")
    s.wait_serving()
    pids = s.rank_pids(2)
    s.proc.kill()  # the launcher dies without a chance to clean up
    s.proc.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in pids)

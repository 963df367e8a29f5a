"""``megascore serve`` as a process: local launcher, signals, lost rank, loading, no orphans.

The engine comes from ``tests.service.dist_fake`` through MEGASCORE_ENGINE_FACTORY.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from megascore.v1 import scoring_pb2 as pb
from megascore_server.procfs import alive
from tests.e2e.serve import ServeProcess
from tests.service.harness import Req, check_response

FAKE_ENGINE = "tests.service.dist_fake:create"


class Serve:
    """``megascore serve`` with the fake engine of ``tests.service.dist_fake``.

    A :class:`ServeProcess` (killed with its ranks at teardown); the fake's ranks write
    their pids, and what they did, into ``tmp_path``.
    """

    def __init__(self, tmp_path: Path, *args: str, env: dict | None = None):
        self.dir = tmp_path
        fake = {"MEGASCORE_ENGINE_FACTORY": FAKE_ENGINE, "MEGASCORE_FAKE_DIR": str(tmp_path)}
        self.server = ServeProcess(
            tmp_path / "serve.log", "--grace-s", "5", *args, env={**fake, **(env or {})}
        )
        self.proc = self.server.proc
        self.stub = self.server.stub()

    def output(self) -> str:
        return self.server.log_path.read_text()

    def health_status(self) -> int | None:
        """Health of the server, or None when nothing answers."""
        try:
            return self.server.health(timeout=1)
        except grpc.RpcError:
            return None

    def wait_answering(self, timeout: float = 60) -> int:
        """Polls until the server answers health; returns that first status."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"serve exited early:\n{self.output()}"
            status = self.health_status()
            if status is not None:
                return status
            time.sleep(0.05)
        raise AssertionError(f"never answered health:\n{self.output()}")

    def wait_serving(self, timeout: float = 60) -> None:
        self.server.wait_serving(timeout)

    def rank_pids(self, n: int, timeout: float = 30) -> list[int]:
        files = [self.dir / f"pid{r}" for r in range(n)]
        end = time.monotonic() + timeout
        while not all(f.exists() and f.read_text() for f in files):
            assert time.monotonic() < end, f"ranks did not start:\n{self.output()}"
            time.sleep(0.05)
        return [int(f.read_text()) for f in files]

    def wait(self, timeout: float = 60) -> int:
        return self.server.wait(timeout)

    def close(self) -> None:
        self.server.close()


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


HOLD = {"MEGASCORE_FAKE_HOLD_LOAD": "1"}
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


def wait_files(*paths: Path, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < end, f"missing {[str(p) for p in paths if not p.exists()]}"
        time.sleep(0.05)


def test_health_not_serving_while_every_rank_loads_then_serving(serve, tmp_path):
    s = serve("--nproc", "2", env=HOLD)
    assert s.wait_answering() == NOT_SERVING  # the server is up before the model
    wait_files(tmp_path / "loading0", tmp_path / "loading1")
    assert s.health_status() == NOT_SERVING
    with pytest.raises(grpc.RpcError) as info:
        s.stub.Score(REQ.proto(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "loading" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    (tmp_path / "release").write_text("")
    s.wait_serving()
    check_response(s.stub.Score(REQ.proto(), timeout=10), REQ)
    # Rank 0 built its engine on the thread that runs its steps.
    built_on = (tmp_path / "built_on").read_text()
    assert built_on.startswith("megascore-engine")
    assert (tmp_path / "step_thread").read_text() == built_on
    pids = s.rank_pids(2)
    os.killpg(s.proc.pid, signal.SIGINT)
    assert s.wait() == 0, s.output()
    assert (tmp_path / "SHUTDOWN").exists() and (tmp_path / "clean1").exists()
    assert not any(alive(pid) for pid in pids)


def test_failed_engine_build_exits_nonzero_never_serving(serve, tmp_path):
    reason = "hf:/ckpt: tensor 'embedding.weight' missing"
    s = serve(env={**HOLD, "MEGASCORE_FAKE_LOAD_ERROR": reason})
    assert s.wait_answering() == NOT_SERVING
    wait_files(tmp_path / "loading0")
    (tmp_path / "release").write_text("")
    seen = set()
    while s.proc.poll() is None:
        seen.add(s.health_status())
        time.sleep(0.02)
    assert SERVING not in seen and NOT_SERVING in seen
    assert s.wait() == 1, s.output()
    assert "building the engine failed" in s.output() and reason in s.output()
    assert s.health_status() is None  # the server stopped with the process


def test_sigterm_while_loading_exits_promptly_without_orphans(serve, tmp_path):
    s = serve("--nproc", "2", env=HOLD)  # the load is never released
    assert s.wait_answering() == NOT_SERVING
    wait_files(tmp_path / "loading0", tmp_path / "loading1")
    pids = s.rank_pids(2)
    os.killpg(s.proc.pid, signal.SIGTERM)
    assert s.wait(timeout=30) == 1, s.output()  # no hang; 1: the load cannot be interrupted
    assert not any(alive(pid) for pid in pids)
    assert "signal while the model is loading" in s.output()
    assert not (tmp_path / "built_on").exists()

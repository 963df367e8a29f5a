"""Under torchrun, SIGTERM drains and the launch exits 0 without a traceback
(``python -m megascore_server.main torchrun ARGS``; plain torchrun re-raises the
signal as a ``SignalException``, exit 1). Engine: ``tests.service.dist_fake``."""

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

from megascore_server.ports import pick_port

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("torch")  # torchrun (the floors venv has no torch)


def _wait_serving(target: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert proc.poll() is None, f"exited early:\n{log.read_text()}"
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise AssertionError(f"never SERVING:\n{log.read_text()}")


def test_sigterm_to_torchrun_drains_every_rank_and_exits_0(tmp_path):
    port = pick_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        MEGASCORE_ENGINE_FACTORY="tests.service.dist_fake:create",
        MEGASCORE_FAKE_DIR=str(tmp_path),
        OMP_NUM_THREADS="1",
    )
    log = tmp_path / "torchrun.log"
    cmd = [
        sys.executable, "-m", "megascore_server.main", "torchrun", "--standalone",
        "--nproc-per-node", "2", "--max-restarts=0", "-m", "megascore_server.main",
        "--port", str(port), "--tp", "2", "--grace-s", "5",
    ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_serving(f"127.0.0.1:{port}", proc, log)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert code == 0, text
    assert "Traceback" not in text and "SignalException" not in text, text
    assert "SIGTERM: 2 local ranks drained, exit 0" in text
    assert (tmp_path / "SHUTDOWN").exists()  # rank 0 drained and broadcast SHUTDOWN

"""scripts/demo_client.py gives up at once when the server process dies during start-up.

scripts/demo.sh passes the server's PID and log; before, the client polled health
for the whole ``--wait`` (300 s) after the server had already died.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO_CLIENT = ROOT / "scripts" / "demo_client.py"
DYING_SERVER = (
    "import sys, time; time.sleep(float(sys.argv[1])); "
    "print('megascore serve: cannot load model bogus (a clue)', flush=True); sys.exit(3)"
)


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there: health calls fail UNAVAILABLE


def _run_client(server: subprocess.Popen, log: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            str(DEMO_CLIENT),
            "--target",
            f"127.0.0.1:{_unused_port()}",
            "--wait",
            "120",
            "--server-pid",
            str(server.pid),
            "--server-log",
            str(log),
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    return done, time.monotonic() - start


def _check(done: subprocess.CompletedProcess, elapsed: float, pid: int) -> None:
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert elapsed < 60, f"waited {elapsed:.0f} s for a dead server"
    assert f"the server (pid {pid}) exited before serving" in done.stderr, done.stderr
    assert "cannot load model bogus (a clue)" in done.stderr, done.stderr  # the log tail


def test_server_dies_while_the_client_waits(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-c", DYING_SERVER, "3"], stdout=out)
    try:
        # The dead server stays a zombie (not reaped here) while the client runs.
        done, elapsed = _run_client(server, log)
    finally:
        server.kill()
        server.wait()
    _check(done, elapsed, server.pid)


def test_server_already_gone(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.run([sys.executable, "-c", DYING_SERVER, "0"], stdout=out)
    assert server.returncode == 3

    class Gone:  # a reaped PID: kill(pid, 0) fails (unless reused, vanishingly unlikely)
        pid = _reaped_pid()

    done, elapsed = _run_client(Gone, log)
    _check(done, elapsed, Gone.pid)


def _reaped_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid

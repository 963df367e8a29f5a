"""Issue 43, item 4 (CI-short): ``scripts/flood.py`` at small sizes.

The script starts its own ``megascore serve --model tiny --http-port P`` with a 1 s
header timeout and a 1 MiB body limit, measures 2 gRPC + 2 HTTP good clients alone,
then under each attack (idle connections, slowloris, unread ScoreStreams, churn, 20
clients sending bodies at and over the limit), 2 s each. It must pass: no failed good
call, RSS and fds back within 5 % after each attack, no 5xx (but 503) / INTERNAL
answered to an attack, no traceback, exit 0 on SIGTERM. The p99 bar is 5x here, not 3x
(why: at ``--max-p99-ratio`` below; the full run's 30 s phases: docs/reliability.md).
The header timeout must have closed slowloris and idle HTTP connections; the bodies
must have been answered 400 / 413 / INVALID_ARGUMENT / RESOURCE_EXHAUSTED. About 40 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.serve import ROOT

SIZES = {
    "--measure-s": 2,
    "--settle-s": 10,
    "--header-timeout-s": 1,
    # 5x, not the full run's 3x: a 2 s phase has ~400 good calls, so its p99 is its 4th
    # slowest call, and one scheduler hiccup on 2 shared cores doubles it. Measured on
    # this code with a full-suite run beside it: 0.81-2.90x (the bodies phase highest);
    # before the fixes the full run's misses were 5x (unread), 8.8x (idle), 142x (bodies).
    "--max-p99-ratio": 5,
    "--idle-http": 300,
    "--idle-grpc": 30,
    "--slowloris": 30,
    "--slowloris-grpc": 5,
    "--trickle-s": 0.3,
    "--unread": 4,
    "--churn-rate": 300,
    "--body-clients": 20,
    "--max-body-bytes": 1 << 20,
}


@pytest.mark.timeout(170)
def test_floods_and_slow_clients_leave_good_clients_served_and_resources_back(tmp_path):
    summary_file = tmp_path / "flood.json"
    command = [sys.executable, str(ROOT / "scripts" / "flood.py"), "--json", str(summary_file)]
    command += [f"{flag}={value}" for flag, value in SIZES.items()]
    proc = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=160,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert out.strip().splitlines()[-1] == "flood: PASS", out[-6000:]
    summary = json.loads(summary_file.read_text())
    rows = {row["attack"]: row for row in summary["rows"]}
    assert list(rows) == ["none", "idle", "slowloris", "unread", "churn", "bodies"]
    assert summary["problems"] == [] and summary["server_exit_code"] == 0
    for row in rows.values():
        assert row["calls"] > 0 and row["failures"] == 0, row
        assert row["fds_growth"] <= 0.05 and row["rss_mib_growth"] <= 0.05, row
    counts = {name: row["counts"] for name, row in rows.items()}
    assert counts["slowloris"]["http slowloris closed by server"] > 0
    assert counts["slowloris"]["grpc slowloris closed by server"] > 0
    assert counts["idle"]["http idle closed by server"] > 0
    assert counts["idle"]["grpc idle opened"] >= SIZES["--idle-grpc"]
    assert counts["churn"]["churn opened and dropped"] >= SIZES["--churn-rate"]
    assert counts["unread"]["unread stream writes"] > 0
    for answer in ("http at limit 400", "http over 413", "http over chunked 413"):
        assert counts["bodies"][answer] > 0, counts["bodies"]
    assert counts["bodies"]["grpc at limit INVALID_ARGUMENT"] > 0, counts["bodies"]
    assert counts["bodies"]["grpc over RESOURCE_EXHAUSTED"] > 0, counts["bodies"]

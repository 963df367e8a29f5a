"""``scripts/soak.py`` end to end with a short duration (slow: run with --run-slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.serve import ROOT


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_soak_script_short_run_passes(tmp_path):
    summary_file = tmp_path / "soak.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "soak.py"),
            "--duration",
            "40",
            "--warmup",
            "10",
            "--report-every",
            "10",
            "--cases",
            "12",
            "--max-len",
            "128",
            "--json",
            str(summary_file),
        ],
        capture_output=True,
        text=True,
        timeout=840,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "soak: PASS" in out and out.count("calls/s") >= 3, out[-6000:]
    summary = json.loads(summary_file.read_text())
    assert summary["failures"] == 0 and summary["mismatches"] == 0 and summary["max_diff"] == 0
    assert summary["server_exit_code"] == 0 and summary["leftover_pids"] == []
    assert summary["calls"] > 0 and summary["rss_kib"]["baseline"] > 0

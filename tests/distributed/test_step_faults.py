"""Issue 16: a rank that raises inside a step fails the call fast (torchrun, 2 gloo ranks).

The CPU run of the logic GPU replicas rely on (``scripts/step_faults.py``): a device
error surfacing when the step waits for its device work is reported through the
status all-reduce at once, and a rank that raises before its collectives leaves its
peer in a collective only for ``collective_timeout_s``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.torchrun import run_check_script

SCRIPT = Path(__file__).parent / "scripts" / "step_faults.py"
NPROC = 2
TIMEOUT_S = 4.0  # scripts/step_faults.py's collective_timeout_s
CHECKS = ("device_error", "raise_in_forward")


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("step_faults")
    result = run_check_script(SCRIPT, NPROC, out_dir, "faults_rank", timeout=300)
    timing_path = out_dir / "faults_timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    return {**result, "timing": timing}


def test_launch_succeeds(faults):
    assert faults["error"] is None, faults["error"]


@pytest.mark.parametrize("name", CHECKS)
def test_every_rank_fails_the_step(faults, name):
    for rank in range(NPROC):
        result = faults["checks"][rank].get(name)
        assert result is not None, f"rank {rank} did not run {name}:\n{faults['error']}"
        assert result == "ok", f"rank {rank} {name}:\n{result}"


def test_calls_fail_fast(faults):
    timing = faults["timing"]
    assert set(timing) == set(CHECKS), faults["error"]
    # Reported through the status flags: no collective waits for a timeout.
    assert timing["device_error"] < TIMEOUT_S, timing
    # Rank 0 waits in its TP collective for one timeout, then the status all-reduce
    # meets rank 1 at once; the status group's own timeout (3x) must not be needed.
    assert timing["raise_in_forward"] < 2.5 * TIMEOUT_S, timing

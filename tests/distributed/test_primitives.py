"""gather_cp_shards and the engine protocol on two gloo ranks.

One torchrun launch runs every check (tests/distributed/scripts/primitives_worker.py);
each test below reports one check on both ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.torchrun import run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "primitives_worker.py"
CHECKS = (
    "gather_cp_shards_matches_single_process_packing",
    "protocol_round_trip",
    "weights_protocol_round_trip",
)
NPROC = 2


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("primitives")
    try:
        output, error = run_torchrun(SCRIPT, NPROC, str(out_dir), timeout=240), None
    except AssertionError as e:
        output, error = "", str(e)
    results = {}
    for rank in range(NPROC):
        path = out_dir / f"rank{rank}.json"
        results[rank] = json.loads(path.read_text()) if path.exists() else {}
    return {"results": results, "error": error, "output": output}


def test_launch_succeeds_and_runs_every_check(outcome):
    assert outcome["error"] is None, outcome["error"]
    for rank in range(NPROC):
        assert sorted(outcome["results"][rank]) == sorted(CHECKS), rank


@pytest.mark.parametrize("name", CHECKS)
def test_check_passes_on_every_rank(outcome, name):
    for rank in range(NPROC):
        result = outcome["results"][rank].get(name)
        assert result is not None, f"rank {rank} did not report {name}:\n{outcome['error']}"
        assert result == "ok", f"rank {rank} {name}:\n{result}"

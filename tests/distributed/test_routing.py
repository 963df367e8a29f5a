"""MoE routing record / replay in TP2 (with and without SP), CP2, EP2 and PP2 layouts.

One 2-rank torchrun launch of ``scripts/routing_layouts.py``: in every layout,
replaying the recorded routes is bit-identical, replaying the reference layout's
routes reproduces the reference logprobs, other routes change them; here the
recorded routes of every layout equal the reference's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.torchrun import run_check_script

SCRIPT = Path(__file__).parent / "scripts" / "routing_layouts.py"
NPROC = 2
LAYOUTS = ("ref", "tp2_sp", "tp2_nosp", "cp2", "ep2", "pp2")  # as in the script


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("routing")
    return {"dir": out_dir, **run_check_script(SCRIPT, NPROC, out_dir, "routing_rank")}


@pytest.mark.parametrize("name", LAYOUTS)
def test_record_and_replay_in_layout(launch, name):
    for rank in range(NPROC):
        result = launch["checks"][rank].get(name)
        assert result is not None, f"rank {rank} did not run {name}:\n{launch['error']}"
        assert result == "ok", f"rank {rank} {name}:\n{result}"


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "ref"])
def test_recorded_routes_equal_the_reference(launch, name):
    """Same experts per token and layer (the order within a token is the router's)."""
    with np.load(launch["dir"] / f"{name}.npz") as got, np.load(launch["dir"] / "ref.npz") as ref:
        assert got["routing"].shape == ref["routing"].shape == (206, 2, 2)
        np.testing.assert_array_equal(np.sort(got["routing"], -1), np.sort(ref["routing"], -1))
        np.testing.assert_allclose(got["logprobs"], ref["logprobs"], rtol=0, atol=1e-5)

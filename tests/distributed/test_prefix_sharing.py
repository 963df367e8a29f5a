"""Shared prefixes vs the dense forward at TP2 (with and without SP), EP2 (two
data-parallel ranks splitting the step by groups), PP2 and CP2 (dense and MoE models).

One 2-rank torchrun launch of ``scripts/prefix_sharing_layouts.py``: per layout the
shared engine's logprobs, top-k and losses are within 1e-6 (fp32) of the dense
engine's on random prefix groups (tests/prefix_groups.py), recorded routes are equal
and replaying them is bit-identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.torchrun import run_check_script

SCRIPT = Path(__file__).parent / "scripts" / "prefix_sharing_layouts.py"
NPROC = 2
LAYOUTS = ("tp2", "moe_tp2_sp", "ep2", "pp2", "cp2", "moe_cp2")  # as in the script


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("prefix_sharing")
    return run_check_script(SCRIPT, NPROC, out_dir, "prefix_rank")


@pytest.mark.parametrize("name", LAYOUTS)
def test_shared_prefixes_match_dense_in_layout(launch, name):
    for rank in range(NPROC):
        result = launch["checks"][rank].get(name)
        assert result is not None, f"rank {rank} did not run {name}:\n{launch['error']}"
        assert result == "ok", f"rank {rank} {name}:\n{result}"

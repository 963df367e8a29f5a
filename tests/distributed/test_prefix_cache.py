"""The prefix cache at TP2 (with and without sequence parallelism, and with a host tier
behind a small device tier), PP2 and EP2 (two data-parallel ranks sharing their cached
blocks) equals an engine without it, bit for bit; under CP2 it is off (one 2-rank torchrun launch of
``scripts/prefix_cache_layouts.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.torchrun import run_check_script

SCRIPT = Path(__file__).parent / "scripts" / "prefix_cache_layouts.py"
NPROC = 2
LAYOUTS = ("tp2", "moe_tp2_sp", "ep2", "pp2", "cp2", "tp2_host")  # as in the script


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    return run_check_script(SCRIPT, NPROC, tmp_path_factory.mktemp("prefix_cache"), "cache_rank")


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_prefix_cache_equals_no_cache_in_layout(launch, name):
    for rank in range(NPROC):
        result = launch["checks"][rank].get(name)
        assert result is not None, f"rank {rank} did not run {name}:\n{launch['error']}"
        assert result == "ok", f"rank {rank} {name}:\n{result}"

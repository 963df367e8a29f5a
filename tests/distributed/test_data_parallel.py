"""Data-parallel ranks split a step: EP=2 (tiny-moe) and DP=2 (tiny) vs one rank.

``scripts/data_parallel.py`` runs once on 1 rank (the reference) and once on 2 ranks
(which replays the reference's recorded routing, shifted); the tests compare the
files rank 0 wrote (module docstring of the script for the cases).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.distributed.scripts.engine_common import load_output
from tests.torchrun import run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "data_parallel.py"
ATOL = 1e-5
CASES = ("moe_edge", "moe_one", "moe_record", "moe_mb2", "moe_mb2_pad", "dense_edge")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    one = tmp_path_factory.mktemp("dp_one")
    two = tmp_path_factory.mktemp("dp_two")
    run_torchrun(SCRIPT, 1, str(one), str(one / "none"), timeout=600)
    run_torchrun(SCRIPT, 2, str(two), str(one), timeout=600)
    for directory, world in ((one, 1), (two, 2)):
        for rank in range(world):
            log = json.loads((directory / f"data_parallel_rank{rank}.json").read_text())
            failed = {k: v for k, v in log.items() if v != "ok"}
            assert not failed, f"world {world} rank {rank}: {failed}"
    return one, two


def _compare(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key == "top_k_ids":
            np.testing.assert_array_equal(a[key], b[key])
        else:  # perplexity = exp(mean NLL): relative
            rtol = ATOL if key == "loss_perplexity" else 0
            np.testing.assert_allclose(a[key], b[key], rtol=rtol, atol=ATOL, err_msg=key)


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one(runs, case):
    """Logprobs, top-k, losses and MoE / MTP metrics of the split step == one rank (pads,
    all-padding microbatches included, weigh nothing)."""
    one, two = runs
    ref, ref_meta = load_output(one / case)
    got, meta = load_output(two / case)
    _compare(ref, got)
    for kind in ("moe_metrics", "mtp_metrics"):
        assert meta[kind].keys() == ref_meta[kind].keys()
        for name, value in ref_meta[kind].items():
            assert meta[kind][name] == pytest.approx(value, abs=ATOL), (kind, name)
    if case.startswith("moe_") and case != "moe_record":
        assert meta["moe_metrics"] and meta["mtp_metrics"]


@pytest.mark.parametrize("case", ["moe_one", "moe_record"])
def test_recorded_routing_equals_one_rank(runs, case):
    one, two = runs
    np.testing.assert_array_equal(
        np.load(two / f"{case}_routing.npy"), np.load(one / f"{case}_routing.npy")
    )


def test_replayed_routing_is_used(runs):
    """The 2-rank launch replays the reference routing shifted by one expert: its output
    equals the given routing and its logprobs differ from the routed ones."""
    one, two = runs
    given = (np.load(one / "moe_record_routing.npy") + 1) % 4
    np.testing.assert_array_equal(np.load(two / "moe_replay_routing.npy"), given)
    routed, _ = load_output(one / "moe_record")
    replayed, _ = load_output(two / "moe_replay")
    assert np.abs(routed["logprobs"] - replayed["logprobs"]).max() > 1e-3


def test_ranks_score_different_sequences(runs):
    """Each DP rank scores its own part: together every sequence once, balanced by tokens."""
    _, two = runs
    parts = [json.loads((two / f"split_rank{r}.json").read_text()) for r in range(2)]
    # every rank builds its own part first; rank 0 then the others' to receive them
    first = [parts[r][0] for r in range(2)]
    assert sorted(first[0] + first[1]) == list(range(11))
    assert first[0] and first[1] and not set(first[0]) & set(first[1])

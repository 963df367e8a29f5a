"""TP / CP / TP x CP / EP layouts give the single-rank logprobs and metrics (4 gloo ranks).

One torchrun launch (tests/distributed/scripts/model_parity_worker.py) runs every
layout; each test below compares one layout on every rank with the reference.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.torchrun import run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "model_parity_worker.py"
NPROC = 4
TOL = 1e-5
# layout -> its single-rank reference. Pads are masked out of the routers' statistics and
# an MTP loss is token-weighted over the CP ranks, so every MoE layout (padded to 4 for
# TP=2 with SP and for CP=2) reports the metrics of the unpadded single-rank reference;
# "ref_tiny_moe_pad4" (one rank, padded to 4) must report them too.
LAYOUTS = {
    "tp2": "ref_tiny",
    "cp2": "ref_tiny",
    "tp2_cp2": "ref_tiny",
    "ep2_moe": "ref_tiny_moe",
    "tp2_sp_ep2_moe": "ref_tiny_moe",
    "cp2_moe": "ref_tiny_moe",
    "ref_tiny_moe_pad4": "ref_tiny_moe",
}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("model_parity")
    try:
        error = None
        run_torchrun(SCRIPT, NPROC, str(out_dir), timeout=540)
    except AssertionError as e:
        error = str(e)
    return out_dir, error


def _load(out_dir: Path, layout: str, rank: int, error: str | None) -> dict:
    path = out_dir / f"{layout}.rank{rank}.npz"
    err = out_dir / f"{layout}.rank{rank}.error"
    if not path.exists():
        detail = err.read_text() if err.exists() else error
        pytest.fail(f"{layout} rank {rank} produced no result:\n{detail}")
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_single_rank(outcome, layout):
    out_dir, error = outcome
    ref = _load(out_dir, LAYOUTS[layout], 0, error)
    for rank in range(NPROC):
        got = _load(out_dir, layout, rank, error)
        diff = np.abs(got["logprobs"] - ref["logprobs"]).max()
        assert diff <= TOL, f"{layout} rank {rank}: max |dlogprob| {diff}"
        metric_names = sorted(k for k in ref if k.startswith("metric."))
        assert sorted(k for k in got if k.startswith("metric.")) == metric_names
        for name in metric_names:
            assert float(got[name]) == pytest.approx(float(ref[name]), rel=TOL, abs=TOL), (
                f"{layout} rank {rank} {name}"
            )


def test_data_parallel_split_reports_the_whole_batch_metrics(outcome):
    """Four DP ranks, each scoring its own sequences of the batch, report the step-level
    metrics of one rank scoring all of them (<= 1e-6)."""
    out_dir, error = outcome
    ref = _load(out_dir, "ref_tiny_moe", 0, error)
    names = sorted(k for k in ref if k.startswith("metric."))
    for rank in range(NPROC):
        got = _load(out_dir, "dp4_split_moe", rank, error)
        assert sorted(k for k in got if k.startswith("metric.")) == names
        for name in names:
            want = float(ref[name])
            assert float(got[name]) == pytest.approx(want, rel=1e-6, abs=1e-6), name


def test_moe_reference_reports_metrics(outcome):
    out_dir, error = outcome
    ref = _load(out_dir, "ref_tiny_moe", 0, error)
    names = {k.removeprefix("metric.") for k in ref if k.startswith("metric.")}
    assert names == {
        "load_balancing_loss",
        "seq_load_balancing_loss",
        "z_loss",
        "mtp_1_loss",
        "mtp_1_acceptance_rate",
    }


def test_launch_succeeded(outcome):
    assert outcome[1] is None, outcome[1]

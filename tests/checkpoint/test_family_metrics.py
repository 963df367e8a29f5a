"""MoE and MTP metrics of the HF MoE families do not depend on the layout or the padding.

One 2-rank torchrun launch (``scripts/metrics_worker.py``) loads the qwen3_moe,
deepseek_v3 (MLA, sigmoid router with groups, shared expert, MoE MTP layer) and glm4_moe
tiny checkpoints at CP=2, TP=2 with sequence parallelism (both padding every sequence to
a multiple of 4), EP=2, and on single ranks with pad multiples 1 and 4. Every layout
reports the metrics of the unpadded single-rank reference (<= 1e-5) and its logprobs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from testkit.checkpoints import MOE_FAMILIES
from tests.torchrun import run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "metrics_worker.py"
NPROC = 2
TOL = 1e-5  # metrics
LOGPROB_TOL = 1e-4  # full log-softmax rows of the larger-weight HF models, any layout
FAMILIES = [f for f in MOE_FAMILIES if f in ("qwen3_moe", "deepseek_v3", "glm4_moe")]
LAYOUTS = ("ref_pad4", "cp2", "tp2_sp", "ep2")


@pytest.fixture(scope="module")
def outcome(hf_dirs, tmp_path_factory):
    work = tmp_path_factory.mktemp("family_metrics")
    for family in FAMILIES:
        (work / f"hf_{family}").symlink_to(hf_dirs[family])
    out = work / "out"
    out.mkdir()
    try:
        error = None
        run_torchrun(SCRIPT, NPROC, str(work), str(out), ",".join(FAMILIES), timeout=580)
    except AssertionError as e:
        error = str(e)
    return out, error


def _load(outcome, family: str, layout: str, rank: int) -> dict:
    out, error = outcome
    path = out / f"{family}.{layout}.rank{rank}.npz"
    if not path.exists():
        err = path.with_suffix(".error")
        detail = err.read_text() if err.exists() else error
        pytest.fail(f"{family} {layout} rank {rank}: no result\n{detail}")
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_metrics_equal_the_unpadded_reference(outcome, family, layout):
    ref = _load(outcome, family, "ref", 0)
    names = sorted(k for k in ref if k.startswith("metric."))
    want = {"qwen3_moe": {"metric.load_balancing_loss"}}.get(
        family,
        {"metric.seq_load_balancing_loss", "metric.mtp_1_loss", "metric.mtp_1_acceptance_rate"},
    )
    assert set(names) == want
    for rank in range(NPROC):
        got = _load(outcome, family, layout, rank)
        diff = np.abs(got["logprobs"] - ref["logprobs"]).max()
        assert diff <= LOGPROB_TOL, f"rank {rank} logprobs {diff}"
        assert sorted(k for k in got if k.startswith("metric.")) == names
        for name in names:
            assert float(got[name]) == pytest.approx(float(ref[name]), rel=TOL, abs=TOL), (
                f"{family} {layout} rank {rank} {name}"
            )

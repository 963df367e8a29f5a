"""HF and Megatron checkpoints at PP=2 and PP=2 x TP=2 (one 4-rank torchrun launch).

``scripts/pp_worker.py`` saves Megatron checkpoints at TP=2, then serves the HF
checkpoints with DistributedEngine at PP=2 and PP=2 x TP=2 and hot-reloads the TP=2
Megatron checkpoints there (``LoadWeights``). Every result must equal the
``transformers`` reference of its weights; the Megatron reload equals the HF load of
the same weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.torchrun import run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "pp_worker.py"
TOL = 1e-4  # vs transformers
LAYOUT_TOL = 1e-5  # same weights, other layout or source
LAYOUTS = ("pp2", "pp2_tp2")


@pytest.fixture(scope="module")
def outcome(hf_dirs, tmp_path_factory):
    work = tmp_path_factory.mktemp("ckpt_pipeline")
    for name in ("llama", "llama_b", "qwen2"):
        (work / f"hf_{name}").symlink_to(hf_dirs[name])
    out = work / "out"
    out.mkdir()
    try:
        run_torchrun(SCRIPT, 4, str(work), str(out), timeout=580)
        error = None
    except AssertionError as e:
        error = str(e)
    return out, error


def _result(outcome, case: str) -> np.ndarray:
    out, error = outcome
    if not (out / f"{case}.npy").exists():
        errors = "\n".join(p.read_text() for p in out.glob("*.error"))
        pytest.fail(f"{case}: no result\n{errors or error}")
    return np.load(out / f"{case}.npy")


def test_launch_succeeds(outcome):
    assert outcome[1] is None, outcome[1]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("weights", ["llama_b", "qwen2"])
def test_hf_checkpoint_at_pp(outcome, hf_dirs, layout, weights):
    want = np.load(hf_dirs[weights] / "reference.npy")
    np.testing.assert_allclose(_result(outcome, f"hf_{layout}_{weights}"), want, atol=TOL)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_megatron_tp2_checkpoint_reloaded_at_pp(outcome, hf_dirs, layout, family):
    got = _result(outcome, f"mg_tp2_to_{layout}_{family}")
    np.testing.assert_allclose(got, np.load(hf_dirs[family] / "reference.npy"), atol=TOL)
    if family == "qwen2":  # the same weights loaded from HF in the same layout
        hf = _result(outcome, f"hf_{layout}_qwen2")
        np.testing.assert_allclose(got, hf, rtol=0, atol=LAYOUT_TOL)
    else:  # the reload replaced other weights
        assert np.abs(got - _result(outcome, f"hf_{layout}_llama_b")).max() > 1e-2

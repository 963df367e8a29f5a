"""Pipeline parallelism through Megatron's schedule: PP layouts of DistributedEngine vs one stage.

One 4-rank torchrun launch (``scripts/engine_pipeline.py``): PP=2, PP=2 x TP=2,
PP=2 x CP=2 (tiny), PP=4 (2 + 1 + 1 + 1 layers of the 5-layer tiny-deep, an
uneven split) and PP=2 x TP=2 (tiny-deep, 3 + 2 layers), PP=2 x EP=2 and PP=2 x TP=2
with sequence parallelism (tiny-moe with MTP, metrics); each scores a batch that
splits into 3 microbatches and must equal the one-stage run of the same model with
the same microbatches: logprobs, top-k, losses (<= 1e-5, fp32), MoE / MTP metrics.
The step-level MoE / MTP metrics also equal those of one stage running the batch in
1 microbatch (<= 1e-6), as do one stage's with 3 and 4 microbatches.
Each stage holds only its own layers.
Failures on the last stage (a raise, a hang) reach rank 0 as WorkerLostError.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.scripts.engine_common import assert_masked_match, load_output, pp_batch
from tests.distributed.test_engine_parity import (
    ATOL,
    assert_metrics_match,
    assert_outputs_match,
)
from tests.torchrun import run_check_script

SCRIPTS = Path(__file__).parent / "scripts"
NPROC = 4
# layout -> (reference, pipeline stages, decoder layers of the model)
LAYOUTS = {
    "tiny_pp2": ("tiny_ref", 2, 2),
    "tiny_pp2_tp2": ("tiny_ref", 2, 2),
    "tiny_pp2_cp2": ("tiny_ref", 2, 2),
    "deep_pp4": ("deep_ref", 4, 5),
    "deep_pp2_tp2": ("deep_ref", 2, 5),
    "moe_pp2_ep2": ("moe_ref", 2, 2),
    "moe_pp2_tp2": ("moe_ref_pad2", 2, 2),
}
# one-stage tiny-moe references: 3 microbatches (unpadded, pad multiple 2), 1 and 4
MOE_REFS = ("moe_ref", "moe_ref_pad2", "moe_ref_mb1", "moe_ref_mb4")
CHECKS = (
    *(f"{name}:run" for name in ("tiny_ref", "deep_ref", *MOE_REFS, *LAYOUTS)),
    "last_stage_failure",
    "hung_last_stage",
)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("engine_pipeline")
    result = run_check_script(
        SCRIPTS / "engine_pipeline.py", NPROC, out_dir, "pipeline_rank", timeout=900
    )
    return {"dir": out_dir, **result}


def test_launch_succeeds(pipeline):
    assert pipeline["error"] is None, pipeline["error"]


@pytest.mark.parametrize("name", CHECKS)
def test_check_on_every_rank(pipeline, name):
    for rank in range(NPROC):
        result = pipeline["checks"][rank].get(name)
        assert result is not None, f"rank {rank} did not run {name}:\n{pipeline['error']}"
        assert result == "ok", f"rank {rank} {name}:\n{result}"


@pytest.mark.parametrize("name", LAYOUTS)
def test_pipeline_layout_matches_one_stage(pipeline, name):
    ref = LAYOUTS[name][0]
    got, want = load_output(pipeline["dir"] / name), load_output(pipeline["dir"] / ref)
    assert_outputs_match(got, want)
    assert got[1]["num_parameters"] == want[1]["num_parameters"]
    if name.startswith("moe"):
        assert set(got[1]["moe_metrics"]) == {
            "load_balancing_loss",
            "seq_load_balancing_loss",
            "z_loss",
        }
        assert set(got[1]["mtp_metrics"]) == {"mtp_1_loss", "mtp_1_acceptance_rate"}


@pytest.mark.parametrize(
    "name", ["moe_ref", "moe_ref_pad2", "moe_ref_mb4", "moe_pp2_ep2", "moe_pp2_tp2"]
)
def test_moe_metrics_do_not_depend_on_microbatches_or_stages(pipeline, name):
    """Step-level metrics (the default): 3 or 4 microbatches, PP=2 x EP=2 and PP=2 x TP=2
    (SP) report the metrics of one stage running the batch as one microbatch (<= 1e-6)."""
    got = load_output(pipeline["dir"] / name)
    assert_metrics_match(got, load_output(pipeline["dir"] / "moe_ref_mb1"))


@pytest.mark.parametrize("name", ["tiny_pp2_tp2", "tiny_pp2_cp2"])
def test_masked_positions_match_the_dense_layout(pipeline, name):
    """``logprob_positions`` masked at PP=2 (x TP=2, x CP=2): the last stage's output
    head on the loss mask's rows only gives the layout's dense results there."""
    masked, _ = load_output(pipeline["dir"] / f"{name}_masked")
    dense, _ = load_output(pipeline["dir"] / name)
    assert_masked_match(masked, dense, pp_batch(), ATOL)


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_stage_holds_only_its_layers(pipeline, name):
    _, pp, num_layers = LAYOUTS[name]
    stages = {}
    for rank in range(NPROC):
        path = pipeline["dir"] / f"{name}_stage_rank{rank}.json"
        stage = json.loads(path.read_text())
        pp_rank = stage.pop("pp_rank")
        assert stages.setdefault(pp_rank, stage) == stage  # the same on every rank of a stage
    assert sorted(stages) == list(range(pp))
    layers = [n for s in range(pp) for n in stages[s]["layers"]]
    assert layers == list(range(1, num_layers + 1)), layers  # in order, each once
    assert stages[0]["embedding"]
    assert [stages[s]["output_layer"] for s in range(pp)] == [False] * (pp - 1) + [True]
    mtp = name.startswith("moe")
    assert [stages[s]["mtp"] for s in range(pp)] == [False] * (pp - 1) + [mtp]

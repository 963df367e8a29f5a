"""Shared prefixes vs the dense forward of ``hf:`` MoE families at TP2 (with SP), CP2, EP2
and PP2: multi-latent attention and Qwen3-MoE.

One 2-rank torchrun launch of ``scripts/prefix_sharing_mla_layouts.py`` on a tiny
DeepSeek-V3 ``hf:`` checkpoint (MLA with a query LoRA and YaRN RoPE, MoE, one MTP
layer) and a tiny Qwen3-MoE one (tests/unit/test_prefix_sharing_mla.py writes them,
with transformers' own initialisation): per family and layout the shared engine's
logprobs, top-k and losses are within 1e-6 (fp32) of the dense engine's on random
prefix groups, the recorded routes are equal and the MoE / MTP metrics of a shared step
are the dense step's within 1e-6 relative.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.torchrun import run_check_script
from tests.unit.test_prefix_sharing_mla import write_mla_checkpoint

SCRIPT = Path(__file__).parent / "scripts" / "prefix_sharing_mla_layouts.py"
NPROC = 2
FAMILIES = ("deepseek_v3", "qwen3_moe")
LAYOUTS = ("tp2", "cp2", "ep2", "pp2")  # as in the script


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    models = []
    for family in FAMILIES:
        checkpoint = tmp_path_factory.mktemp(family)
        write_mla_checkpoint(family, checkpoint)
        models.append(f"{family}={checkpoint}")
    out_dir = tmp_path_factory.mktemp("prefix_sharing_mla")
    return run_check_script(SCRIPT, NPROC, out_dir, "prefix_mla_rank", *models)


@pytest.mark.parametrize("name", [f"{f} {layout}" for f in FAMILIES for layout in LAYOUTS])
def test_hf_moe_shared_prefixes_match_dense_in_layout(launch, name):
    for rank in range(NPROC):
        result = launch["checks"][rank].get(name)
        assert result is not None, f"rank {rank} did not run {name}:\n{launch['error']}"
        assert result == "ok", f"rank {rank} {name}:\n{result}"

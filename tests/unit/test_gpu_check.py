"""scripts/gpu_check.sh on a machine without CUDA: runs to the end with a "no CUDA" table.

The table is what a GPU run records in docs/deploy.md; here every GPU row must be
SKIP "no CUDA", the version rows present (HAVE_TE / HAVE_BRIDGE as this interpreter
sees them), a missing TransformerEngine a WARN row, and the exit status 0. A failed
row makes the script exit 1.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
HEADER = "| check | result | seconds | detail |"
INFO_ROWS = (
    "python",
    "torch",
    "megatron-core",
    "transformer-engine",
    "transformers",
    "megatron-bridge",
    "HAVE_TE",
    "HAVE_BRIDGE",
)


def _driver():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parse(stdout: str) -> dict[str, tuple[str, float, str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    assert lines[0] == HEADER and lines[1] == "|---|---|---|---|", lines[:2]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 4, line
        check, result, seconds, detail = cells
        assert result in ("PASS", "FAIL", "SKIP", "WARN", "INFO"), line
        rows[check] = (result, float(seconds), detail)
    return rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs the GPU check")
def test_runs_to_the_end_with_a_no_cuda_table():
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _parse(proc.stdout)
    from megascore.checkpoint.hf_bridge import have_bridge
    from megascore.model.build import HAVE_TE

    for name in INFO_ROWS:
        assert rows[name][0] == "INFO", name
    assert rows["HAVE_TE"][2] == str(HAVE_TE)
    assert rows["HAVE_BRIDGE"][2] == str(have_bridge())
    assert rows["torch"][2].startswith(torch.__version__)
    warn = rows.pop("TransformerEngine", None)
    assert (warn is None) == HAVE_TE, "a missing TE must be a visible row"
    assert warn is None or (warn[0] == "WARN" and warn[2].startswith("absent"))
    gpu = {name: row for name, row in rows.items() if name not in INFO_ROWS}
    assert set(gpu) == set(_driver().GPU_ROWS)
    assert all(result == "SKIP" and detail == "no CUDA" for result, _, detail in gpu.values())
    want = f"gpu_check: 0 pass, 0 fail, {len(gpu)} skip, {0 if HAVE_TE else 1} warn"
    assert proc.stdout.strip().splitlines()[-1] == want


def test_a_failed_check_is_a_row_and_the_exit_status(capsys):
    table = _driver().Table()
    table.add("ok", "PASS", 1.0)
    table.run("broken", lambda: 1 / 0)
    assert table.print() == 1
    rows = _parse(capsys.readouterr().out)
    assert rows["broken"][0] == "FAIL" and "ZeroDivisionError" in rows["broken"][2]
    assert rows["ok"] == ("PASS", 1.0, "")


def test_the_prefix_sharing_row_runs_shared_against_dense_on_the_cpu():
    """The row a GPU run fills (tiny here, float32): the shared engine really shares,
    its logprobs equal the dense engine's and the detail gives the ideal ratio."""
    spec = importlib.util.spec_from_file_location(
        "gpu_prefix_sharing", ROOT / "scripts" / "gpu_prefix_sharing.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from tests.one_rank import one_rank_world

    with one_rank_world():
        result, detail = module.prefix_sharing("tiny", "cpu", "float32")
    assert result == "PASS", detail
    batch = module.grpo_batch(512)
    ideal = batch.num_tokens / module.computed_rows(batch)
    assert ideal > 2 and f"(ideal {ideal:.2f}x" in detail

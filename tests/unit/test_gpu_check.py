"""scripts/gpu_check.py: the plan, the deadline and the "no CUDA" table.

The dry run prints the plan whose default run (kit install included) fits the 8
minutes; a row is stopped at its window's end and the rows written before it stay;
``gpu_check.sh`` on a machine without CUDA runs to the end with every GPU row SKIP
"no CUDA" and exit status 0. The rows' windows are sized for a quiet host, so
scripts/suite.py runs this module alone, in its quiet phase.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.script_module import script_module

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


def test_the_dry_run_plans_the_default_run_inside_the_deadline():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    last = re.fullmatch(r"gpu_check: planned (\d+) s of (\d+) s", lines[-1])
    planned, deadline = int(last[1]), int(last[2])
    assert deadline == 480 and planned <= deadline
    plan = [(line, m) for line in lines if (m := re.search(r"share (\d+) s, ends (\d+)$", line))]
    ends = [int(m[2]) for _, m in plan]
    assert ends == sorted(ends) and ends[-1] == planned
    assert sum(int(m[1]) for _, m in plan) == planned  # the kit install's share included
    assert "kit install" in plan[0][0]
    keys = [line.split()[0] for line, _ in plan[1:]]
    checker = script_module("gpu_check")
    assert keys == [row.key for row in checker.ROWS if row.default]
    assert keys[:2] == ["versions", "parity"]  # parity first, then performance
    assert keys.index("startup-8b") < keys.index("mla")
    single = {"mla", "fp8", "top-k", "lm-head", "attention-lse", "memory"}
    assert single <= set(keys)


def test_rows_are_picked_by_key_in_the_given_order():
    checker = script_module("gpu_check")
    assert [r.key for r in checker.pick("memory,parity")] == ["memory", "parity"]
    assert len(checker.pick("all")) == len(checker.ROWS)
    with pytest.raises(SystemExit, match="unknown rows"):
        checker.pick("parity,nope")


def test_a_row_is_stopped_at_its_window_and_earlier_rows_are_written(tmp_path, monkeypatch):
    checker = script_module("gpu_check")
    monkeypatch.setattr(checker, "GRACE_S", 0.5)
    jsonl = tmp_path / "gpu_check.jsonl"
    first = "import json; print(json.dumps({'row': ['first', 'PASS', 0.1, 'done']}))"
    # the second row reports what the first left in OUT, then hangs past its window
    hang = (
        f"import json, time; rows = open({str(jsonl)!r}).read().count('first');"
        "print(json.dumps({'row': ['second sees', 'INFO', 0.0, f'{rows} rows']}), flush=True);"
        "time.sleep(60)"
    )
    scripts = {"a": first, "b": hang, "c": first}
    monkeypatch.setattr(
        checker, "worker_command", lambda row, *_: [sys.executable, "-c", scripts[row.key]]
    )
    rows = [checker.Row(key, key, share, "") for key, share in (("a", 1.5), ("b", 1.5), ("c", 9))]
    start = time.time()
    table = checker.run(rows, "cpu", tmp_path, start, deadline_s=3.5, install_s=0.0)
    assert time.time() - start < 3.5 + checker.GRACE_S + 1.0
    got = {check: (result, detail) for check, result, _, detail in table.rows}
    assert got["first"] == ("PASS", "done")
    assert got["second sees"] == ("INFO", "1 rows")
    assert got["b"][0] == "FAIL" and "window's end" in got["b"][1]
    assert got["c"][0] == "SKIP" and got["c"][1].startswith("deadline")
    written = [json.loads(line)["row"][0] for line in jsonl.read_text().splitlines()]
    assert written == ["first", "second sees", "b", "c"]
    assert (tmp_path / "gpu_check.md").read_text().count("\n") == 2 + len(written)


def test_a_failed_row_is_a_row_and_the_exit_status(tmp_path, capsys):
    checker = script_module("gpu_check")
    table = checker.Table(tmp_path)
    table.add("ok", "PASS", 1.0)
    row = checker.Row("broken", "broken", 10, "")
    checker.run_row(table, row, [sys.executable, "-c", "1 / 0"], 10)
    assert table.print() == 1
    rows = _parse(capsys.readouterr().out)
    assert rows["broken"][0] == "FAIL" and "ZeroDivisionError" in rows["broken"][2]
    assert rows["ok"] == ("PASS", 1.0, "")


def test_host_syncs_fail_above_the_per_layer_limit_on_a_gpu():
    sys.path.insert(0, str(ROOT / "scripts"))
    rows = script_module("gpu_check_rows")
    limit = rows.SYNCS_PER_LAYER
    clean = Counter({("step", "_local_scalar_dense"): 9, ("layer", "nonzero"): int(limit * 4)})
    synced = Counter({("layer", "_local_scalar_dense"): int(limit * 4) + 1})
    assert rows.judge_syncs(clean, 4, "cuda")[0] == "PASS"
    result, detail = rows.judge_syncs(synced, 4, "cuda")
    assert result == "FAIL" and f"({int(limit * 4) + 1} in 4 layers" in detail
    assert rows.judge_syncs(synced, 4, "cpu")[0] == "INFO"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs the GPU check")
def test_runs_to_the_end_with_a_no_cuda_table(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path))
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
    checker = script_module("gpu_check")
    assert set(gpu) == {row.check for row in checker.pick(None)} - {"versions"}
    assert all(result == "SKIP" and detail == "no CUDA" for result, _, detail in gpu.values())
    want = f"gpu_check: 0 pass, 0 fail, {len(gpu)} skip, {0 if HAVE_TE else 1} warn"
    assert proc.stdout.strip().splitlines()[-1] == want
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert (tmp_path / "gpu_check.md").read_text().splitlines() == table  # written to $OUT


def test_the_prefix_sharing_row_runs_shared_against_dense_on_the_cpu():
    """The row a GPU run fills (tiny here, float32): the shared engine really shares,
    its logprobs equal the dense engine's and the detail gives the ideal ratio."""
    module = script_module("gpu_prefix_sharing")
    from tests.one_rank import one_rank_world

    with one_rank_world():
        result, detail = module.prefix_sharing("tiny", "cpu", "float32")
    assert result == "PASS", detail
    batch = module.grpo_batch(512)
    ideal = batch.num_tokens / module.computed_rows(batch)
    assert ideal > 2 and f"(ideal {ideal:.2f}x" in detail


def test_the_prefix_cache_row_runs_turn_by_turn_against_no_cache_on_the_cpu():
    """The row a GPU run fills (tiny here, float32): the cache's logprobs from each turn
    on equal the engine's without it, with and without a host tier behind a small device
    tier, and both read the histories (the tiers moving blocks out and back)."""
    module = script_module("gpu_prefix_sharing")
    from tests.one_rank import one_rank_world

    with one_rank_world():
        result, detail = module.prefix_cache("tiny", "cpu", "float32")
    assert result == "PASS", detail
    assert detail.count("logprob 0.00e+00") == 2 and " 0 of " not in detail
    assert re.search(r"tiers: .* [1-9]\d* moved to the host and [1-9]\d* back", detail), detail

"""``megascore score`` (the installed console script, a subprocess) against a real server.

The CLI scores a JSONL file on the shared ``--nproc 1`` server, is stopped after a few
rows (``--limit``) with a half-written line at the end of its output, and resumes. The
output must hold every row once, in input order, with the numbers the SDK gets from the
same server for the same sequences.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

from megascore.api import reference_kl, schema
from megascore_client import ScoringClient, score_jsonl
from megascore_client.jsonl_rows import RowLimits
from testkit.reference import VOCAB

MEGASCORE = Path(sys.executable).with_name("megascore")  # the venv's console script


def _rows(seed: int = 3, num: int = 9) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(num):
        ids = rng.integers(0, VOCAB, int(rng.integers(4, 60))).tolist()
        row = {"id": f"r{i}", "token_ids": ids}
        if i % 3 == 1:
            row["loss_mask"] = [0] * (len(ids) // 2) + [1] * (len(ids) - len(ids) // 2)
        rows.append(row)
    return rows


def _cli(target: str, src: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [str(MEGASCORE), "score", "--target", target, str(src), "-o", str(out),
           "--top-k", "2", "--batch-tokens", "64", "--no-progress", *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


def _summary(stdout: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in stdout.strip().splitlines() if ": " in line)


def test_cli_scores_resumes_and_matches_the_sdk(tp1, tmp_path):
    rows = _rows()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))

    first = _cli(tp1.target, src, out, "--limit", "4")
    assert first.returncode == 0, first.stderr
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [
        "r0",
        "r1",
        "r2",
        "r3",
    ]
    with out.open("a") as f:  # an interrupted write of the next row
        f.write('{"id": "r4", "num_tokens": 7, "logpr')

    second = _cli(tp1.target, src, out)
    assert second.returncode == 0, second.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in got] == [r["id"] for r in rows]  # all, once, input order
    assert _summary(second.stdout)["rows"].startswith(f"{len(rows)} (scored 5, skipped 4")

    with ScoringClient(tp1.target) as client:
        ref = client.score(
            [r["token_ids"] for r in rows],
            loss_mask=[r.get("loss_mask", [1] * len(r["token_ids"])) for r in rows],
            top_k=2,
        )
    for i, (row, out_row) in enumerate(zip(rows, got, strict=True)):
        assert out_row["num_tokens"] == len(row["token_ids"])
        np.testing.assert_array_equal(
            np.asarray(out_row["logprobs"], np.float32), ref.logprobs[i], err_msg=row["id"]
        )
        np.testing.assert_array_equal(np.asarray(out_row["top_k_ids"]), ref.top_k_ids[i])
        np.testing.assert_array_equal(
            np.asarray(out_row["top_k_logprobs"], np.float32), ref.top_k_logprobs[i]
        )
        assert math.isclose(out_row["nll"], float(ref.loss["nll"][i]), rel_tol=1e-6)
        assert out_row["num_loss_tokens"] == int(ref.num_tokens[i])
    mean_nll = sum(r["nll"] for r in got) / sum(r["num_loss_tokens"] for r in got)
    assert math.isclose(
        float(_summary(second.stdout)["mean NLL per token"]), mean_nll, rel_tol=1e-5
    )


def test_cli_names_bad_rows_and_sets_them_aside(tp1, tmp_path):
    """Against the real model's limits (``GetModelInfo``): each bad row is named by its
    line and id; without ``--skip-invalid`` the run stops after the rows before it, with
    it the bad rows go to the side file and the good ones match the SDK."""
    with ScoringClient(tp1.target) as client:
        info = client.model_info()
    limits = RowLimits.from_model_info(info)
    rows = _rows(seed=5, num=8)
    bad = {
        3: {"id": "oov", "token_ids": [1, info.vocab_size]},
        5: {"id": "long", "token_ids": [1] * (limits.max_tokens + 1)},
        7: {"id": "frac", "token_ids": [1, 2.5, 3]},
    }
    lines = [json.dumps(r) for r in rows]
    for at in sorted(bad):
        lines.insert(at, json.dumps(bad[at]))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")  # line = index + 1

    stopped = _cli(tp1.target, src, out, "--batch-tokens", "16")
    assert stopped.returncode == 1
    assert (
        f'{src}:4 (id "oov"): token_ids[1] = {info.vocab_size} is not below the model\'s '
        f"vocab_size {info.vocab_size}" in stopped.stderr
    ), stopped.stderr
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["r0", "r1", "r2"]

    out.unlink()
    skipped = _cli(tp1.target, src, out, "--skip-invalid")
    assert skipped.returncode == 0, skipped.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in got] == [r["id"] for r in rows]
    side_file = out.with_name("out.rejected.jsonl")
    side = [json.loads(line) for line in side_file.read_text().splitlines()]
    assert [(r["line"], r["id"]) for r in side] == [(4, "oov"), (6, "long"), (8, "frac")]
    assert side[1]["reason"] == (
        f"{limits.max_tokens + 1} tokens, more than the model's {limits.max_tokens_name} "
        f"{limits.max_tokens}"
    )
    assert side[2]["reason"] == "token_ids[1] = 2.5 is not an integer"
    with ScoringClient(tp1.target) as client:
        ref = client.score([r["token_ids"] for r in rows], top_k=2)
    for i, out_row in enumerate(got):
        np.testing.assert_array_equal(np.asarray(out_row["logprobs"], np.float32), ref.logprobs[i])


def test_cli_rows_with_rollout_logprobs_get_their_mismatch(tp1, tmp_path):
    """A row's ``rollout_logprobs`` comes back as its ``mismatch`` (the SDK's numbers);
    rows without one (scored in other requests) have none."""
    rows = _rows(seed=5, num=5)
    rng = np.random.default_rng(7)
    for row in rows[::2]:
        row["rollout_logprobs"] = rng.normal(-6.0, 1.0, len(row["token_ids"])).tolist()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = _cli(tp1.target, src, out)
    assert done.returncode == 0, done.stderr
    written = [json.loads(line) for line in out.read_text().splitlines()]
    with ScoringClient(tp1.target, timeout=120) as client:
        for row, got in zip(rows, written, strict=True):
            assert got["id"] == row["id"]
            if "rollout_logprobs" not in row:
                assert "mismatch" not in got
                continue
            want = client.score(
                [row["token_ids"]],
                loss_mask=[row["loss_mask"]] if "loss_mask" in row else None,
                rollout_logprobs=[row["rollout_logprobs"]],
            ).mismatch[0]
            assert got["mismatch"].keys() == want.keys()
            for name, value in want.items():
                assert math.isclose(got["mismatch"][name], value, rel_tol=1e-6, abs_tol=1e-6)


def test_cli_writes_every_output_of_the_table(tp1, tmp_path):
    """Every flag the CLI derives from the table asked at once, rows carrying target ids
    and rollout logprobs: each row holds every output of ``schema.OUTPUTS`` the model
    has (routing only on a MoE model; the reference outputs only with a second weight
    set) under its name, equal to the SDK's answer to the same request."""
    rows = _rows(seed=11, num=4)
    rng = np.random.default_rng(11)
    for row in rows:
        n = len(row["token_ids"])
        row["rollout_logprobs"] = rng.normal(-6.0, 1.0, n).tolist()
        row["target_ids"] = rng.integers(0, VOCAB, (n, 3)).tolist()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with ScoringClient(tp1.target, timeout=120) as client:
        moe = bool(client.model_info().moe_metric_names)
        flags = {
            o.name: True
            for o in score_jsonl._row_options()
            if o.names is None and (moe or o.name != "return_routing")
        }
        ref = client.score(
            [r["token_ids"] for r in rows],
            loss_mask=[r.get("loss_mask", [1] * len(r["token_ids"])) for r in rows],
            target_ids=[r["target_ids"] for r in rows],
            rollout_logprobs=[r["rollout_logprobs"] for r in rows],
            top_k=2,
            **flags,
        )
    done = _cli(tp1.target, src, out, *("--" + name.replace("_", "-") for name in flags))
    assert done.returncode == 0, done.stderr
    written = [json.loads(line) for line in out.read_text().splitlines()]
    # the reference outputs need a second weight set (tests/e2e/test_weight_sets_served.py)
    reference = {"reference_logprobs", "kl", *(f"kl_{k}" for k in reference_kl.NAMES)}
    expected = {o.name for o in schema.OUTPUTS if moe or o.name != "routing"} - reference
    assert len(expected) >= 12 and "target_logprobs" in expected
    for i, got in enumerate(written):
        assert expected <= got.keys(), expected - got.keys()
        for output in schema.OUTPUTS:
            if output.name not in expected:
                continue
            want = getattr(ref, output.sdk)
            if output.keys is not None:
                assert got[output.name].keys() == want.keys()
                for name, values in want.items():
                    assert math.isclose(got[output.name][name], values[i], rel_tol=1e-6)
            else:
                np.testing.assert_array_equal(
                    np.asarray(got[output.name], output.dtype), want[i], err_msg=output.name
                )

"""The ``megascore`` CLI end to end against a real server (fake Scorer)."""

from __future__ import annotations

import argparse
import ast
import asyncio
import importlib.metadata
import importlib.util
import json
import math
import sys
import threading
import tomllib
import types
from pathlib import Path

import grpc
import numpy as np
import pytest

from megascore_client import AsyncScoringClient, RetryPolicy, ScoringClient, cli, waiting
from megascore_client.cli import main
from tests.client.fake_server import VOCAB, FakeScorer, FakeServer, ref_logprobs, ref_nll

ROWS = [
    {"id": "a", "token_ids": [1, 2, 3, 4]},
    [5, 6, 7],
    {"token_ids": [8, 9, 10, 11, 12], "loss_mask": [0, 0, 1, 1, 1]},
    {"id": 42, "token_ids": list(range(20, 60))},
    [7, 7],
    {"id": "z", "token_ids": [300, 301, 302, 303, 304, 305]},
    {"id": ["tuple", 1], "token_ids": [9, 9, 9]},
]
IDS = ["a", 1, 2, 42, 4, "z", ["tuple", 1]]
ROOT = Path(__file__).resolve().parents[2]


def _write_input(path, rows=ROWS):
    lines = [json.dumps(r) for r in rows]
    lines.insert(2, "")  # blank lines are ignored (and do not count as rows)
    path.write_text("\n".join(lines) + "\n")
    return path


def _read_output(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _expected_nll(row):
    ids = row if isinstance(row, list) else row["token_ids"]
    mask = None if isinstance(row, list) else row.get("loss_mask")
    return ref_nll(ids, mask)


def _summary(text: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in text.strip().splitlines())


def test_score_end_to_end(server, tmp_path, capsys):
    src, out = _write_input(tmp_path / "in.jsonl"), tmp_path / "out" / "scored.jsonl"
    rc = main(["score", "--target", server.target, str(src), "-o", str(out), "--top-k", "2",
               "--batch-tokens", "16", "--no-progress"])  # fmt: skip
    assert rc == 0
    rows = _read_output(out)
    assert [r["id"] for r in rows] == IDS
    for row, got in zip(ROWS, rows, strict=True):
        ids = row if isinstance(row, list) else row["token_ids"]
        assert got["num_tokens"] == len(ids)
        assert got["nll"] == pytest.approx(_expected_nll(row), rel=1e-6)
        np.testing.assert_array_equal(np.float32(got["logprobs"]), ref_logprobs(ids))
        assert np.array(got["top_k_ids"]).shape == (len(ids), 2)
        assert got["top_k_ids"][0] == [-1, -1]
    assert rows[2]["num_loss_tokens"] == 3
    assert len(server.scorer.requests) > 1  # batched by --batch-tokens
    summary = _summary(capsys.readouterr().out)
    assert summary["rows"].startswith("7 (scored 7, skipped 0")
    total_nll = sum(_expected_nll(r) for r in ROWS)
    loss_tokens = sum(r["num_loss_tokens"] for r in rows)
    assert float(summary["mean NLL per token"]) == pytest.approx(total_nll / loss_tokens, rel=1e-5)
    assert float(summary["perplexity"]) == pytest.approx(math.exp(total_nll / loss_tokens), 1e-4)
    assert summary["tokens"].startswith(f"{sum(r['num_tokens'] for r in rows)} (")


def test_resume_after_row_limit_and_truncated_line(server, tmp_path, capsys):
    src, out = _write_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    args = ["score", "--target", server.target, str(src), "-o", str(out), "--no-progress",
            "--batch-tokens", "4", "--no-logprobs"]  # fmt: skip
    assert main([*args, "--limit", "3"]) == 0
    assert [r["id"] for r in _read_output(out)] == IDS[:3]
    assert "logprobs" not in _read_output(out)[0]
    with out.open("a") as f:  # an interrupted write of the 4th row
        f.write('{"id": 42, "num_tokens": 40, "num_loss_')
    capsys.readouterr()
    scored_before = sum(r["num_sequences"] for r in server.scorer.requests)
    assert main(args) == 0
    rows = _read_output(out)
    assert [r["id"] for r in rows] == IDS  # no duplicates, input order, all rows
    assert sum(r["num_sequences"] for r in server.scorer.requests) - scored_before == 4
    summary = _summary(capsys.readouterr().out)
    assert summary["rows"].startswith("7 (scored 4, skipped 3")
    total = sum(_expected_nll(r) for r in ROWS) / sum(r["num_loss_tokens"] for r in rows)
    assert float(summary["mean NLL per token"]) == pytest.approx(total, rel=1e-5)
    assert main(args) == 0  # nothing left to do
    assert _summary(capsys.readouterr().out)["rows"].startswith("7 (scored 0, skipped 7")
    assert len(_read_output(out)) == 7


def test_resume_from_partial_output_matches_a_full_run(server, tmp_path):
    src = _write_input(tmp_path / "in.jsonl")
    full, partial = tmp_path / "full.jsonl", tmp_path / "partial.jsonl"
    base = ["score", "--target", server.target, str(src), "--no-progress", "--top-k", "1"]
    assert main([*base, "-o", str(full)]) == 0
    lines = full.read_text().splitlines(keepends=True)
    partial.write_text(lines[0] + lines[1] + lines[2][: len(lines[2]) // 2])
    assert main([*base, "-o", str(partial)]) == 0
    assert partial.read_text() == full.read_text()
    partial.write_text(lines[0] + "{broken\n" + lines[1])
    assert main([*base, "-o", str(partial)]) == 2  # corruption before the end: refuse


def _word_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "megascore": 3, "scores": 4, "tokens": 5}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return tok


def _text_rows(tmp_path):
    rows = [{"id": "t1", "text": "hello world"}, {"id": "t2", "text": "megascore scores tokens"}]
    return _write_input(tmp_path / "texts.jsonl", rows)


def test_text_rows_with_tokenizers_fallback(server, tmp_path, monkeypatch):
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    _word_tokenizer().save(str(tok_dir / "tokenizer.json"))
    monkeypatch.setitem(sys.modules, "transformers", None)  # force the `tokenizers` path
    src, out = _text_rows(tmp_path), tmp_path / "out.jsonl"
    rc = main(["score", "--target", server.target, str(src), "-o", str(out),
               "--tokenizer", str(tok_dir), "--no-progress"])  # fmt: skip
    assert rc == 0
    rows = _read_output(out)
    np.testing.assert_array_equal(np.float32(rows[1]["logprobs"]), ref_logprobs([3, 4, 5]))
    assert [r["num_tokens"] for r in rows] == [2, 3]


@pytest.mark.slow  # importing transformers' tokenizer classes takes 10-25 s on a busy CPU
def test_text_rows_with_transformers_auto_tokenizer(server, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok_dir = tmp_path / "hf"
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_word_tokenizer(), unk_token="[UNK]"
    )
    fast.save_pretrained(str(tok_dir))
    src, out = _text_rows(tmp_path), tmp_path / "out.jsonl"
    rc = main(["score", "--target", server.target, str(src), "-o", str(out),
               "--tokenizer", str(tok_dir), "--no-progress"])  # fmt: skip
    assert rc == 0
    np.testing.assert_array_equal(
        np.float32(_read_output(out)[0]["logprobs"]), ref_logprobs([1, 2])
    )


def test_info_health_load_weights(server, capsys):
    target = ["--target", server.target]
    assert main(["info", *target]) == 0
    assert json.loads(capsys.readouterr().out)["vocab_size"] == VOCAB
    assert main(["health", *target]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    server.set_serving(False)
    assert main(["health", *target]) == 1
    assert capsys.readouterr().out.strip() == "NOT_SERVING"
    assert main(["health", *target, "--wait", "0.5"]) == 1
    server.set_serving(True)
    assert main(["health", *target, "--wait", "5"]) == 0
    capsys.readouterr()
    assert main(["load-weights", "hf:/ckpt", "--weights-version", "w9", *target]) == 0
    loaded = json.loads(capsys.readouterr().out)
    assert loaded["weights_version"] == "w9" and loaded["previous_weights_version"] == "v0"
    assert main(["load-weights", "bogus", *target]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    stopped = server.target
    server.stop()
    assert main(["health", "--target", stopped, "--timeout", "1"]) == 1
    # Retried as UNAVAILABLE until the deadline runs out.
    assert capsys.readouterr().out.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED"))


def test_load_weights_honours_timeout_and_shows_progress(capsys):
    """``load-weights --timeout`` is the load's deadline (not a fixed 600 s); a load
    longer than a second draws an elapsed-time line on stderr, the SDK calls
    ``progress(elapsed_s)``."""
    with FakeServer(FakeScorer()) as srv:
        srv.scorer.load_delay_s = 2.5
        target = ["--target", srv.target]
        assert main(["load-weights", "hf:/ckpt", *target, "--timeout", "0.5"]) == 1
        assert "DEADLINE_EXCEEDED" in capsys.readouterr().err
        assert main(["load-weights", "hf:/ckpt", *target, "--timeout", "30"]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["weights_version"] and "loading hf:/ckpt ... 2 s" in err
        seen: list[float] = []
        with ScoringClient(srv.target) as client:
            client.load_weights("hf:/ckpt", progress=seen.append)
        assert len(seen) >= 2 and seen == sorted(seen) and 0.9 < seen[0] < seen[-1] < 2.6
        seen_async: list[float] = []

        async def load_async():
            async with AsyncScoringClient(srv.target) as client:
                return await client.load_weights("hf:/ckpt", progress=seen_async.append)

        assert asyncio.run(load_async()).weights_version
        assert len(seen_async) >= 2 and 0.9 < seen_async[0] < seen_async[-1] < 2.6


def test_token_flag_and_env(tmp_path, capsys, monkeypatch):
    with FakeServer(FakeScorer(token="abc")) as srv:
        assert main(["info", "--target", srv.target]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert main(["info", "--target", srv.target, "--token", "abc"]) == 0
        monkeypatch.setenv("MEGASCORE_TOKEN", "abc")
        monkeypatch.setenv("MEGASCORE_TARGET", srv.target)
        assert main(["info"]) == 0
        assert srv.scorer.metadata[-1]["authorization"] == "Bearer abc"


def test_score_errors(server, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('[1, 2]\n{"token_ids": [1,\n')
    target = ["--target", server.target, "--no-progress", "-o", str(out)]
    assert main(["score", str(bad_json), *target]) == 1
    assert "bad.jsonl:2: invalid JSON" in capsys.readouterr().err
    texts = _text_rows(tmp_path)
    assert main(["score", str(texts), *target]) == 1
    assert "--tokenizer" in capsys.readouterr().err
    dup = _write_input(tmp_path / "dup.jsonl", [{"id": 1, "token_ids": [1]}, [2, 3]])
    assert main(["score", str(dup), *target]) == 1
    assert "duplicate id 1" in capsys.readouterr().err
    out.unlink(missing_ok=True)
    oov = _write_input(tmp_path / "oov.jsonl", [[1, 2], [3, VOCAB + 1]])
    assert main(["score", str(oov), *target]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    assert main(["score", str(tmp_path / "missing.jsonl"), *target]) == 2


def _commands(**targets: str):
    """A stand-in for ``importlib.metadata.entry_points`` holding ``targets`` as the
    commands of the CLI's entry point group (nothing in any other group)."""

    def entry_points(*, group: str, name: str):
        eps = [
            importlib.metadata.EntryPoint(name=n, value=value, group=cli.COMMAND_GROUP)
            for n, value in targets.items()
        ]
        return importlib.metadata.EntryPoints(eps).select(group=group, name=name)

    return entry_points


def test_serve_runs_the_entry_point_of_the_command_group(monkeypatch, capsys):
    seen = []
    fake = types.ModuleType("fake_megascore_server")
    fake.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "fake_megascore_server", fake)
    monkeypatch.setattr(cli, "entry_points", _commands(serve="fake_megascore_server:main"))
    assert main(["serve", "--model", "tiny", "--port", "0"]) == 3
    assert seen == [["--model", "tiny", "--port", "0"]]

    # The entry point names a module whose dependencies are missing (no server extra).
    monkeypatch.setitem(sys.modules, "fake_megascore_server", None)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "needs the server extra" in err and "'fake_megascore_server'" in err
    assert "pip install 'megascore[server]'" in err

    # No server installed at all: no `serve` command in the group.
    monkeypatch.setattr(cli, "entry_points", _commands(other="fake_megascore_server:main"))
    assert main(["serve", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert f"no 'serve' entry point in group {cli.COMMAND_GROUP!r}" in err
    assert "pip install 'megascore[server]'" in err


def test_the_package_declares_the_serve_command():
    """pyproject.toml registers the server's main as the ``serve`` command, and it exists."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = project["entry-points"][cli.COMMAND_GROUP]["serve"]
    assert target == "megascore_server.main:main"
    module, _, attr = target.partition(":")
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    assert any(isinstance(n, ast.FunctionDef) and n.name == attr for n in tree.body)


def test_score_waits_for_a_server_that_is_down(tmp_path, capsys, monkeypatch):
    """``--wait-for-server``: started while its server is down, ``megascore score`` waits
    (connection refused, then two "model loading" answers) and scores everything."""
    monkeypatch.setattr(waiting, "INITIAL_BACKOFF_S", 0.02)
    monkeypatch.setattr(waiting, "MAX_BACKOFF_S", 0.1)
    made = []

    def short_retries_client(target, **kwargs):  # gRPC's own retries: 3 x 0.05 s
        made.append(kwargs)
        policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.05)
        return ScoringClient(target, retries=policy, **kwargs)

    monkeypatch.setattr(cli, "ScoringClient", short_retries_client)
    scorer = FakeScorer()
    server = FakeServer(scorer).start()
    server.stop()  # its port, closed
    loading = (grpc.StatusCode.UNAVAILABLE, "server is starting: model loading")

    def start():
        scorer.fail_next += [loading] * 2
        server.start()

    src, out = _write_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    args = ["score", "--target", server.target, str(src), "-o", str(out), "--no-progress"]
    starter = threading.Timer(1.0, start)
    starter.start()
    try:
        assert main([*args, "--wait-for-server", "30"]) == 0
        assert made[-1]["wait_for_server_s"] == 30 and made[-1]["timeout"] == 90  # 60 + wait
        assert [r["id"] for r in _read_output(out)] == IDS
        assert scorer.calls["GetModelInfo"] == 3  # two "model loading", then the answer
        capsys.readouterr()
        # Without the flag, UNAVAILABLE fails the run once gRPC's retries are spent.
        out.unlink()
        scorer.fail_next += [loading] * 3
        assert main(args) == 1
        assert made[-1]["wait_for_server_s"] == 0 and made[-1]["timeout"] == 60
        assert "UNAVAILABLE" in capsys.readouterr().err
        assert main([*args, "--wait-for-server", "5", "--timeout", "8"]) == 0
        assert made[-1]["wait_for_server_s"] == 5 and made[-1]["timeout"] == 8
    finally:
        starter.join()
        server.stop()
    # The per-request deadline must leave room for the wait: a usage error otherwise.
    for bad in (["--wait-for-server", "30", "--timeout", "30"], ["--wait-for-server", "-1"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*args, *bad])
        assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--timeout (30 s) must exceed --wait-for-server (30 s)" in err
    assert "expected a number of seconds >= 0, got '-1'" in err


def test_every_cli_option_has_help_with_its_default():
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in sub.choices.items():
        for action in command._actions:
            if action.dest == "help":
                continue
            assert action.help, (name, action.option_strings)
            takes_value = action.nargs != 0 and action.option_strings
            if takes_value and action.default not in (None, ""):
                assert "default" in action.help, (name, action.option_strings, action.help)

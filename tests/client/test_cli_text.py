"""``megascore score`` with text rows and the server's tokenizer, ``--echo-tokens``, the
feedback while waiting for a server, and the progress bar's total (fake Scorer with a
real ``tokenizers`` tokenizer: :mod:`tests.client.text_server`)."""

from __future__ import annotations

import json
import re
import threading

import grpc
import numpy as np
import pytest

from megascore_client import RetryPolicy, ScoringClient, cli, waiting
from megascore_client.cli import main
from tests.client.fake_server import FakeScorer, FakeServer, ref_logprobs
from tests.client.text_server import TextScorer, word_tokenizer

TEXT_ROWS = [
    {"id": "a", "text": "t5 t9 t300"},
    {"id": "b", "token_ids": [4, 8]},
    {"id": "c", "text": "t7 t7"},
]


def _run(target, tmp_path, *flags, rows=TEXT_ROWS):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["score", "--target", target, str(src), "-o", str(out), *flags])
    lines = out.read_text().splitlines() if out.exists() else []
    return code, [json.loads(line) for line in lines]


def test_text_rows_use_the_servers_tokenizer_and_echo_tokens(tmp_path, capsys):
    tok = word_tokenizer()
    with FakeServer(TextScorer()) as server:
        code, rows = _run(server.target, tmp_path, "--echo-tokens", "--no-progress")
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"tokenizer: the server's, at {server.target}" in err
    expected = [tok.encode("t5 t9 t300").ids, [4, 8], tok.encode("t7 t7").ids]
    assert expected[0] == [1, 5, 9, 300]
    assert [r["token_ids"] for r in rows] == expected
    assert rows[0]["tokens"] == ["t1", "t5", "t9", "t300"] and rows[1]["tokens"] == ["t4", "t8"]
    for row, ids in zip(rows, expected, strict=True):
        np.testing.assert_array_equal(np.float32(row["logprobs"]), ref_logprobs(ids))
        assert row["num_tokens"] == len(ids)


def test_a_local_tokenizer_wins_and_is_named(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # the `tokenizers` path
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    word_tokenizer().save(str(tok_dir / "tokenizer.json"))
    with FakeServer(TextScorer()) as server:
        code, rows = _run(
            server.target, tmp_path, "--tokenizer", str(tok_dir), "--no-special-tokens",
            "--echo-tokens", "--no-progress",
        )  # fmt: skip
        calls = dict(server.scorer.calls)
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"tokenizer: local, from {tok_dir} (--tokenizer)" in err
    assert rows[0]["token_ids"] == [5, 9, 300] and rows[0]["tokens"] == ["t5", "t9", "t300"]
    assert "Tokenize" not in calls and "Detokenize" not in calls


def test_without_any_tokenizer_text_rows_are_refused_and_echo_gives_ids(tmp_path, capsys):
    with FakeServer(TextScorer(has_tokenizer=False)) as server:
        code, _ = _run(server.target, tmp_path, "--no-progress")
        assert code == 1
        assert "pass --tokenizer DIR" in capsys.readouterr().err
        code, rows = _run(
            server.target, tmp_path, "--echo-tokens", "--no-progress", rows=TEXT_ROWS[1:2]
        )
    assert code == 0
    assert "rows carry token_ids only" in capsys.readouterr().err
    assert rows[0]["token_ids"] == [4, 8] and "tokens" not in rows[0]


def test_waiting_for_the_server_is_said_with_the_time_waited(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(waiting, "INITIAL_BACKOFF_S", 0.05)
    monkeypatch.setattr(waiting, "MAX_BACKOFF_S", 0.1)

    def short_retries_client(target, **kwargs):  # gRPC's own retries: 2 x 0.05 s
        policy = RetryPolicy(max_attempts=2, initial_backoff_s=0.05, max_backoff_s=0.05)
        return ScoringClient(target, retries=policy, **kwargs)

    monkeypatch.setattr(cli, "ScoringClient", short_retries_client)
    scorer = FakeScorer()
    server = FakeServer(scorer).start()
    server.stop()  # its port, closed
    loading = (grpc.StatusCode.UNAVAILABLE, "server is starting: model loading")

    def start():
        scorer.fail_next.append(loading)
        server.start()

    starter = threading.Timer(1.5, start)
    starter.start()
    try:
        code, rows = _run(server.target, tmp_path, "--wait-for-server", "30", "--no-progress",
                          rows=TEXT_ROWS[1:2])  # fmt: skip
    finally:
        starter.join()
        server.stop()
    captured = capsys.readouterr()
    assert code == 0 and len(rows) == 1
    assert f"waiting up to 30 s for the server at {server.target}: UNAVAILABLE" in captured.err
    answered = re.search(r"the server at \S+ answered after ([\d.]+) s", captured.err)
    assert answered and float(answered[1]) >= 1.0, captured.err
    elapsed = float(re.search(r"elapsed: ([\d.]+) s", captured.out)[1])
    assert elapsed >= 1.4  # the wait counts: not the 0.04 s of scoring alone


@pytest.mark.parametrize("limit", [None, 2])
def test_the_progress_bar_has_a_total(tmp_path, capsys, limit):
    pytest.importorskip("tqdm")
    rows = [{"id": i, "token_ids": [1, 2, i + 3]} for i in range(5)]
    flags = () if limit is None else ("--limit", str(limit))
    with FakeServer(FakeScorer()) as server:
        done = {"id": 0, "num_tokens": 3, "num_loss_tokens": 2, "nll": 1.0}
        (tmp_path / "out.jsonl").write_text(json.dumps(done) + "\n")  # resumed: row 0 is done
        code, out = _run(server.target, tmp_path, *flags, rows=rows)
    err = capsys.readouterr().err
    assert code == 0 and len(out) == (5 if limit is None else 3)
    total = 4 if limit is None else 2
    assert f"{total}/{total}" in err and "row" in err and "tok/s" in err, err


def test_the_token_comes_from_a_file(tmp_path, capsys):
    (tmp_path / "token").write_text("s3cret\n")
    with FakeServer(FakeScorer(token="s3cret")) as server:
        target = ["--target", server.target]
        assert main(["info", *target, "--token-file", str(tmp_path / "token")]) == 0
        assert main(["info", *target]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_on_wait_hears_each_resend_and_the_answer(monkeypatch):
    monkeypatch.setattr(waiting, "INITIAL_BACKOFF_S", 0.05)
    monkeypatch.setattr(waiting, "MAX_BACKOFF_S", 0.1)
    scorer = FakeScorer()
    loading = (grpc.StatusCode.UNAVAILABLE, "server is starting: model loading")
    scorer.fail_next += [loading] * 3
    heard = []
    with FakeServer(scorer) as server:
        client = ScoringClient(
            server.target, retries=None, wait_for_server_s=10, timeout=20,
            on_wait=lambda waited, error: heard.append((waited, error)),
        )  # fmt: skip
        with client:
            client.model_info()
    assert [e.code if e else None for _, e in heard] == [grpc.StatusCode.UNAVAILABLE] * 3 + [None]
    waited = [w for w, _ in heard]
    assert waited == sorted(waited) and waited[-1] > 0.1  # from the first UNAVAILABLE on

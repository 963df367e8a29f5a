"""``megascore score`` names every bad row by FILE:LINE and id, stops after the rows
before it (or sets it aside with ``--skip-invalid``), and traces rows the server
refuses back to their line, however the rows were batched and split."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megascore_client.cli import main
from megascore_client.score_jsonl import rejected_path
from tests.client.fake_server import VOCAB, FakeScorer, FakeServer, ref_logprobs, ref_nll

MAX_LEN = 1024  # the fake server's max_sequence_length
BAD_LINE = 15  # the line of row index 12 (two blank lines before it)
SMALL_BATCH = "8"  # tokens per CLI batch: several batches in flight around the bad row
BATCHINGS = pytest.mark.parametrize(
    "batch_tokens", [[], ["--batch-tokens", SMALL_BATCH]], ids=["default", "small"]
)
INDEX_IDS = ("bool id", "empty object")  # rows without an id: named by their index (12)

# kind -> (the bad line, the id the CLI must name or None, what the reason must say)
BAD_ROWS = {
    "negative id": ('{"id": "neg", "token_ids": [1, -3]}', "neg", "token_ids[1] = -3 is negative"),
    "string ids": ('{"id": "str", "token_ids": "1 2 3"}', "str", "token_ids is a string"),
    "id >= vocab": (
        json.dumps({"id": "oov", "token_ids": [1, 2, VOCAB]}),
        "oov",
        f"token_ids[2] = {VOCAB} is not below the model's vocab_size {VOCAB}",
    ),
    "float id": ('{"id": "f", "token_ids": [1, 2.5]}', "f", "token_ids[1] = 2.5 is not an integer"),
    "bool id": ("[4, true, 5]", 12, "token_ids[1] = true is not an integer"),
    "nested list": ('{"id": 7.5, "token_ids": [[1, 2]]}', 7.5, "token_ids[0] is a list, not an"),
    "too long": (
        json.dumps({"id": "long", "token_ids": [3] * (MAX_LEN + 1)}),
        "long",
        f"{MAX_LEN + 1} tokens, more than the model's max_sequence_length {MAX_LEN}",
    ),
    "mask length": (
        '{"id": "mask", "token_ids": [1, 2, 3], "loss_mask": [1, 1]}',
        "mask",
        "loss_mask has 2 entries for 3 tokens",
    ),
    "mask value": (
        '{"id": "m2", "token_ids": [1, 2, 3], "loss_mask": [0, 2, 1]}',
        "m2",
        "loss_mask[1] = 2 is not 0 or 1",
    ),
    "mask not a list": (
        '{"id": "m3", "token_ids": [1, 2], "loss_mask": "11"}',
        "m3",
        "loss_mask is a string",
    ),
    "missing token_ids": ('{"id": "none", "tokens": [1, 2]}', "none", "missing 'token_ids'"),
    "bad JSON": ('{"id": "json", "token_ids": [1,', None, "invalid JSON"),
    "empty row": ('{"id": "empty", "token_ids": []}', "empty", "empty token sequence"),
    "empty object": ("{}", 12, "missing 'token_ids'"),
    "non-object row": ('"hello"', None, "expected an object or a list of token ids, got a string"),
    "null row": ("null", None, "expected an object or a list of token ids, got null"),
    "text without tokenizer": ('{"id": "txt", "text": "hi"}', "txt", "pass --tokenizer DIR"),
    "duplicate id": ('{"id": "r3", "token_ids": [1, 2]}', "r3", 'duplicate id "r3"'),
    "routing length": (
        '{"id": "rt", "token_ids": [1, 2], "routing": [[[0, 1]]]}',
        "rt",
        "routing is not [2][num_moe_layers][topk] lists of expert ids",
    ),
    "ragged routing": (
        '{"id": "rr", "token_ids": [1, 2], "routing": [[[0, 1]], [[0]]]}',
        "rr",
        "routing is not [2][num_moe_layers][topk]",
    ),
    "negative expert": (
        '{"id": "rn", "token_ids": [1], "routing": [[[0, -1]]]}',
        "rn",
        "routing: expert ids must be integers >= 0",
    ),
}


def _good_rows(count: int = 24, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        ids = rng.integers(0, VOCAB, int(rng.integers(3, 12))).tolist()
        row = {"id": f"r{i}", "token_ids": ids}
        if i % 4 == 1:
            row["loss_mask"] = [i % 2 for i in range(len(ids))]
        rows.append(row)
    return rows


def _write(path, lines: list[str]) -> None:
    """Writes ``lines`` with blank lines after the 3rd and 7th row (line != index + 1)."""
    out = []
    for i, line in enumerate(lines):
        out.append(line)
        if i in (2, 6):
            out.append("")
    path.write_text("\n".join(out) + "\n")


def _line_of(index: int) -> int:
    """The 1-based line of row ``index`` as written by :func:`_write`."""
    return index + 1 + (index > 2) + (index > 6)


def _ids(path) -> list:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def _check_values(path, rows: dict[str, dict]) -> None:
    for got in map(json.loads, path.read_text().splitlines()):
        row = rows[got["id"]]
        np.testing.assert_array_equal(np.float32(got["logprobs"]), ref_logprobs(row["token_ids"]))
        assert got["nll"] == pytest.approx(ref_nll(row["token_ids"], row.get("loss_mask")))


def _score(target, src, out, *extra) -> int:
    return main(["score", "--target", target, str(src), "-o", str(out), "--no-progress", *extra])


def test_line_numbers_of_the_helper():
    assert [_line_of(i) for i in (0, 2, 3, 6, 7, 12)] == [1, 3, 5, 8, 10, BAD_LINE]


@BATCHINGS
@pytest.mark.parametrize("kind", list(BAD_ROWS))
def test_a_bad_row_stops_the_run_naming_its_line(server, tmp_path, capsys, kind, batch_tokens):
    bad_line, bad_id, reason = BAD_ROWS[kind]
    rows = _good_rows()
    lines = [json.dumps(r) for r in rows]
    lines.insert(12, bad_line)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(src, lines)
    assert _score(server.target, src, out, *batch_tokens) == 1
    err = capsys.readouterr().err
    name = "" if bad_id is None else f" (id {json.dumps(bad_id)})"
    assert f"{src}:{BAD_LINE}{name}: " in err and reason in err, err
    # Every row before the bad one is scored and written; nothing after it is sent.
    before = [r["id"] for r in rows[:12]]
    assert _ids(out) == before
    assert sum(r["num_sequences"] for r in server.scorer.requests) == 12
    _check_values(out, {r["id"]: r for r in rows})
    assert not rejected_path(out).exists()
    # Fixed, the same command resumes after the rows already written.
    lines[12] = json.dumps({"id": "fixed", "token_ids": [5, 6, 7]})
    _write(src, lines)
    assert _score(server.target, src, out, *batch_tokens) == 0
    assert _ids(out) == [*before, "fixed", *(r["id"] for r in rows[12:])]
    assert "scored 13, skipped 12" in capsys.readouterr().out


@BATCHINGS
def test_skip_invalid_sets_bad_rows_aside(server, tmp_path, capsys, batch_tokens):
    rows = _good_rows(40, seed=1)
    lines = [json.dumps(r) for r in rows]
    expected = []
    for i, (kind, (bad_line, bad_id, reason)) in enumerate(BAD_ROWS.items()):
        index = 2 * i + 1  # every kind, at every other row (later inserts come after)
        lines.insert(index, bad_line)
        expected.append((_line_of(index), index if kind in INDEX_IDS else bad_id, reason))
    src, out = tmp_path / "data.jsonl", tmp_path / "scored.jsonl"
    _write(src, lines)
    assert _score(server.target, src, out, "--skip-invalid", *batch_tokens) == 0
    assert f"rejected: {len(BAD_ROWS)} (listed in" in capsys.readouterr().out
    assert _ids(out) == [r["id"] for r in rows]
    _check_values(out, {r["id"]: r for r in rows})
    side = tmp_path / "scored.rejected.jsonl"
    assert rejected_path(out) == side
    records = [json.loads(line) for line in side.read_text().splitlines()]
    assert [(r["line"], r["id"]) for r in records] == [(line, i) for line, i, _ in expected]
    for record, (_, _, reason) in zip(records, expected, strict=True):
        assert reason in record["reason"]
    # Resumed: nothing left to score; the side file lists the same rows again.
    assert _score(server.target, src, out, "--skip-invalid", *batch_tokens) == 0
    assert "scored 0, skipped 40" in capsys.readouterr().out
    assert [json.loads(line) for line in side.read_text().splitlines()] == records


class TrustingScorer(FakeScorer):
    """Reports a vocabulary larger than the one it accepts, so the CLI's own check lets
    out-of-vocabulary rows through and only the server refuses them."""

    def GetModelInfo(self, request, context):
        info = super().GetModelInfo(request, context)
        info.vocab_size = 10 * VOCAB
        return info


@pytest.mark.parametrize("server_tokens", [0, 30], ids=["whole", "split"])
@pytest.mark.parametrize("batch_tokens", [[], ["--batch-tokens", "20"]], ids=["default", "small"])
def test_rows_the_server_refuses_are_traced_to_their_line(
    tmp_path, capsys, batch_tokens, server_tokens
):
    """``split``: the server takes 30 tokens per request, so the SDK cuts each CLI batch
    into several requests and the server counts sequences within one of them."""
    rows = _good_rows(30, seed=2)
    for index in (12, 19):  # the server refuses these two rows
        rows[index]["token_ids"][1] = VOCAB + index
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(src, [json.dumps(r) for r in rows])
    scorer = TrustingScorer(max_request_tokens=server_tokens)
    with FakeServer(scorer) as srv:
        assert _score(srv.target, src, out, *batch_tokens) == 1
        err = capsys.readouterr().err
        assert f'{src}:{BAD_LINE} (id "r12"): refused: token_ids: sequence ' in err, err
        assert f"has id {VOCAB + 12} >= vocab_size" in err
        assert _ids(out) == [r["id"] for r in rows[:12]]
        if server_tokens:
            assert len(scorer.requests) > 3 and all(
                r["num_tokens"] <= server_tokens for r in scorer.requests
            )
        out.unlink()
        assert _score(srv.target, src, out, "--skip-invalid", *batch_tokens) == 0
    good = [r for i, r in enumerate(rows) if i not in (12, 19)]
    assert _ids(out) == [r["id"] for r in good]
    _check_values(out, {r["id"]: r for r in good})
    records = [json.loads(line) for line in rejected_path(out).read_text().splitlines()]
    assert [(r["line"], r["id"]) for r in records] == [(BAD_LINE, "r12"), (_line_of(19), "r19")]
    assert all(r["reason"].startswith("refused: token_ids: sequence ") for r in records)


def test_model_limits_come_from_model_info(tmp_path, capsys):
    """A server taking fewer tokens per request than its longest sequence: a row over
    that limit cannot be sent whole, and is named with the limit that binds."""
    rows = [{"id": "a", "token_ids": [1] * 40}, {"id": "b", "token_ids": [2] * 10}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(src, [json.dumps(r) for r in rows])
    with FakeServer(FakeScorer(max_request_tokens=32)) as srv:
        assert _score(srv.target, src, out, "--skip-invalid") == 0
        assert srv.scorer.calls["GetModelInfo"] == 1
    assert _ids(out) == ["b"]
    (record,) = [json.loads(line) for line in rejected_path(out).read_text().splitlines()]
    assert record == {
        "line": 1,
        "id": "a",
        "reason": "40 tokens, more than the model's max_request_tokens 32",
    }

"""``megascore score`` writes every output of the table and spells every row option of it
as a flag, read from ``megascore.api.schema`` at call time: an entry added to the table
(here, in the test) reaches the output rows and the parser without an edit in the CLI."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types

import numpy as np
import pytest

from megascore.api import schema
from megascore_client import score_jsonl
from megascore_client.jsonl_rows import Row, check_target_ids

PROBE = schema.Output(
    "probe_scores",
    schema.TOKEN,
    "float32",
    "probe_scores",
    "probe_scores",
    wanted=lambda o: o.return_probe,
    dims=lambda o: (2,),
)
PROBE_FLAG = schema.Option("return_probe", False, any, convert=bool)
OPTIONS = types.SimpleNamespace(top_k=3, losses=("nll",), num_target_ids=2)
LENGTHS = (4, 6)


def _value(output: schema.Output, rng) -> object:
    """A result attribute as the SDK holds it: per token a list of ``[L, *dims]`` arrays,
    per sequence a ``[B, *dims]`` array, or for a map output a dict of ``[B]`` arrays."""
    dims = (2, 3) if output.dims is None else schema.flat_dims(output, OPTIONS)
    dtype = np.dtype(output.dtype)

    def draw(shape):
        if dtype.kind == "f":
            return rng.normal(size=shape).astype(dtype)
        return rng.integers(0, 50, shape).astype(dtype)

    if output.keys is not None:
        return {k: draw((len(LENGTHS),)) for k in ("a", "b")}
    if output.per == schema.TOKEN:
        return [draw((n, *dims)) for n in LENGTHS]
    return draw((len(LENGTHS), *dims))


def test_a_row_holds_every_output_of_the_table_a_new_one_too(monkeypatch):
    monkeypatch.setattr(schema, "OUTPUTS", (*schema.OUTPUTS, PROBE))
    rng = np.random.default_rng(0)
    result = types.SimpleNamespace(**{o.sdk: _value(o, rng) for o in schema.OUTPUTS})
    result.loss["nll"] = np.array([1.5, 2.5])
    rows = [Row(i + 1, f"r{i}", list(range(n))) for i, n in enumerate(LENGTHS)]
    text, stats = score_jsonl._format_rows(
        rows, (result, None), argparse.Namespace(echo_tokens=False)
    )
    written = [json.loads(line) for line in text.splitlines()]
    assert [s[0] for s in stats] == list(LENGTHS)
    for i, row in enumerate(written):
        assert row["id"] == f"r{i}" and row["nll"] == result.loss["nll"][i]
        names = [k for k in row if k not in ("id", "num_tokens", "nll")]
        assert names == [o.name for o in schema.OUTPUTS]  # all, in the table's order
        for output in schema.OUTPUTS:
            want = getattr(result, output.sdk)
            if output.keys is not None:
                assert row[output.name] == {k: v[i].item() for k, v in want.items()}
            else:  # exact: float32 in its shortest round-trip form
                np.testing.assert_array_equal(np.asarray(row[output.name], output.dtype), want[i])


def test_an_output_the_result_lacks_is_left_out():
    rng = np.random.default_rng(1)
    result = types.SimpleNamespace(**{o.sdk: None for o in schema.OUTPUTS})
    result.loss = {"nll": np.array([0.5])}
    result.num_tokens = np.array([3])
    result.logprobs = [rng.normal(size=4).astype(np.float32)]
    rows = [Row(1, "only", [1, 2, 3, 4])]
    text, _ = score_jsonl._format_rows(rows, (result, None), argparse.Namespace(echo_tokens=False))
    assert list(json.loads(text)) == [
        "id",
        "num_tokens",
        "nll",
        "logprobs",
        "losses",
        "num_loss_tokens",
    ]


def test_every_row_option_of_the_table_is_a_flag_a_new_one_too(monkeypatch):
    monkeypatch.setattr(schema, "OPTIONS", (*schema.OPTIONS, PROBE_FLAG))
    parser = argparse.ArgumentParser()
    score_jsonl.add_arguments(parser)
    flags = {a.dest: a for a in parser._actions}
    spelled = [o.name for o in score_jsonl._row_options()]
    wanted = {"return_entropy", "return_token_ranks", "return_next_token", "return_routing"}
    wanted |= {"return_importance_weights", "return_probe", "logprob_positions"}
    assert wanted <= set(spelled)
    assert not {"return_moe_metrics", "return_mtp_metrics", "return_logprobs"} & set(spelled)
    for name in spelled:
        assert name in flags and flags[name].option_strings == ["--" + name.replace("_", "-")]
    args = parser.parse_args(
        ["in.jsonl", "-o", "o.jsonl", "--return-probe", "--logprob-positions", "masked"]
    )
    assert args.return_probe is True and args.logprob_positions == "masked"
    assert parser.parse_args(["in.jsonl", "-o", "o.jsonl"]).logprob_positions == "all"


def test_a_row_may_carry_every_per_token_input_it_names():
    """The row inputs the CLI sends are SDK keywords and fields of :class:`Row`: every
    per-token input of the wire but the loss mask."""
    fields = {f.name for f in dataclasses.fields(Row)}
    assert set(score_jsonl._ROW_INPUTS) <= fields
    table = {i.name for i in schema.INPUTS if i.per == schema.TOKEN and i.wire} - {"loss_mask"}
    assert set(score_jsonl._ROW_INPUTS) == table


@pytest.mark.parametrize(
    ("target_ids", "reason"),
    [
        ([[1, 2]] * 3, None),
        ([[1, 2]] * 2, "target_ids is not [3][K] lists of token ids"),
        ([[1, 2], [3], [4, 5]], "target_ids is not [3][K] lists of token ids"),
        ([[1, -2]] * 3, "target_ids: ids must be integers >= 0"),
        ("x", "target_ids is a string; expected [3][K] lists of token ids"),
    ],
)
def test_target_ids_rows_are_checked_where_they_are_read(target_ids, reason):
    values, error = check_target_ids(target_ids, 3)
    assert (error or "").startswith(reason or "")
    assert (values is None) == (reason is not None)
    if values is not None:
        assert values.dtype == np.int64 and values.shape == (3, 2)

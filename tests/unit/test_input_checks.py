"""The per-sequence scalar inputs (temperature, mismatch ratio cap) have one check each,
the table's (``megascore.api.schema.check_input``): the SDK before sending, the wire
gate on ``ScoreOptions`` and ``ScoreBatch.check`` in the engine all run it, so changing
the rule in the table changes what all three accept."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megascore.api import schema
from megascore.api.errors import InvalidRequestError
from megascore.api.limits import Limits
from megascore.api.types import ScoreBatch
from megascore.v1 import scoring_pb2 as pb
from megascore_client.errors import InvalidInputError
from megascore_client.splitting import ScoreOptions
from megascore_server.validation import validate_options

LIMITS = Limits(vocab_size=10, max_sequence_length=8, max_top_k=4, loss_names=("nll",))
CASES = [
    ("temperature", 0.7, True),
    ("temperature", 0.0, False),
    ("temperature", float("inf"), False),
    ("temperature", 1e39, False),  # beyond float32
    ("mismatch_ratio_cap", 2.0, True),
    ("mismatch_ratio_cap", 1.0, False),
    ("mismatch_ratio_cap", float("nan"), False),
]


def _three_sides(name: str, value: float) -> list[bool]:
    """Whether the SDK, the wire gate and the engine's batch check accept ``value``."""
    accepted = []
    try:
        ScoreOptions(**{name: value})
        accepted.append(True)
    except InvalidInputError as exc:
        assert name in str(exc)
        accepted.append(False)
    try:
        validate_options(pb.ScoreOptions(**{name: value}), LIMITS)
        accepted.append(True)
    except InvalidRequestError as exc:
        assert f"options.{name}" in str(exc)
        accepted.append(False)
    batch = ScoreBatch(
        token_ids=np.array([1, 2, 3]),
        lengths=np.array([3]),
        rollout_logprobs=np.zeros(3),
        **{name: np.array([value], np.float64)},
    )
    try:
        batch.check(LIMITS)
        accepted.append(True)
    except InvalidRequestError as exc:
        assert name in str(exc)
        accepted.append(False)
    return accepted


@pytest.mark.parametrize(("name", "value", "ok"), CASES)
def test_the_sdk_the_wire_gate_and_the_engine_agree(name, value, ok):
    assert (schema.check_input(name, value) is None) is ok
    assert _three_sides(name, value) == [ok, ok, ok]


def test_changing_the_rule_in_the_table_changes_all_three(monkeypatch):
    spec = next(s for s in schema.INPUTS if s.name == "temperature")
    stricter = dataclasses.replace(
        spec, check=lambda v: None if (np.asarray(v) <= 2).all() else "must be <= 2"
    )
    table = tuple(stricter if s is spec else s for s in schema.INPUTS)
    monkeypatch.setattr(schema, "INPUTS", table)
    assert _three_sides("temperature", 1.5) == [True, True, True]
    assert _three_sides("temperature", 3.0) == [False, False, False]

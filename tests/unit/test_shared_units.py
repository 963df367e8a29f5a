"""Group-aware step planning (issue 35): the server's planning units against the rows
the engine's prefix tree really computes for the same sequences."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megascore.api.layout import padded_lengths
from megascore.engine.layout.prefix_tree import shared_layout
from megascore_server.batch_assembly import fill_step
from megascore_server.shared_units import planning_units
from tests.service.test_batch_assembly import make_batch

MIN_SHARED, PAD = 16, 4


def grpo(rng, prompts: int, n: int, prompt_len: int, response_len: int, prefix=()) -> list:
    seqs = []
    for _ in range(prompts):
        prompt = [*prefix, *rng.integers(1, 1000, prompt_len).tolist()]
        for _ in range(n):
            seqs.append(prompt + rng.integers(1, 1000, rng.integers(1, response_len)).tolist())
    order = rng.permutation(len(seqs))  # the groups' members need not be neighbours
    return [seqs[i] for i in order]


def engine_rows(batch, members: np.ndarray, pad: int = PAD, lead_rows: int = 1) -> int:
    """Rows the engine's prefix tree computes for ``members`` in one step."""
    starts = np.concatenate([[0], np.cumsum(batch.lengths)])
    ids = np.concatenate([batch.token_ids[starts[i] : starts[i + 1]] for i in members])
    labels = batch.temperatures()[members]
    layout = shared_layout(
        ids, batch.lengths[members], min_shared=MIN_SHARED, labels=labels, lead_rows=lead_rows
    )
    return int(padded_lengths(layout.lengths, pad).sum())


def check_partition(units, n: int) -> None:
    got = np.sort(np.concatenate(units))
    np.testing.assert_array_equal(got, np.arange(n))


def test_each_grpo_group_is_one_unit_costed_as_the_engine_computes_it():
    rng = np.random.default_rng(0)
    batch = make_batch(grpo(rng, prompts=3, n=5, prompt_len=200, response_len=60))
    units, costs = planning_units(batch, PAD, MIN_SHARED, budget=100_000)
    check_partition(units, 15)
    assert sorted(u.size for u in units) == [5, 5, 5]
    for unit, cost in zip(units, costs, strict=True):
        assert cost == engine_rows(batch, unit)  # one flat group: the estimate is exact
    dense = int(padded_lengths(batch.lengths, PAD).sum())
    assert costs.sum() < 0.5 * dense


@pytest.mark.parametrize("pad", [1, PAD, 64, 128])
def test_nested_prefixes_cost_what_the_engine_computes(pad):
    """A system prompt over three prompt groups, at pad multiples small and large
    against the shortest shared prefix: the unit costs the engine's padded segments."""
    rng = np.random.default_rng(1)
    for _ in range(5):
        system = rng.integers(1, 1000, rng.integers(16, 60)).tolist()
        seqs = grpo(rng, prompts=3, n=4, prompt_len=int(rng.integers(16, 150)), response_len=30)
        batch = make_batch([system + s for s in seqs])
        units, costs = planning_units(batch, pad, MIN_SHARED, budget=100_000)
        assert len(units) == 1 and costs[0] == engine_rows(batch, units[0], pad)


def test_sequences_at_other_temperatures_share_nothing():
    rng = np.random.default_rng(6)
    batch = make_batch(grpo(rng, prompts=1, n=4, prompt_len=100, response_len=20))
    batch = dataclasses.replace(batch, temperature=np.array([1.0, 1.0, 0.5, 0.7], np.float32))
    units, costs = planning_units(batch, PAD, MIN_SHARED, budget=100_000)
    assert sorted(u.size for u in units) == [1, 1, 2]
    for unit, cost in zip(units, costs, strict=True):
        assert cost == engine_rows(batch, unit)


def test_a_unit_over_the_budget_is_cut_at_its_weakest_link_then_into_runs():
    rng = np.random.default_rng(2)
    system = rng.integers(1, 1000, 40).tolist()
    batch = make_batch(grpo(rng, prompts=3, n=4, prompt_len=120, response_len=30, prefix=system))
    whole = planning_units(batch, PAD, MIN_SHARED, budget=100_000)[1][0]
    one_group = max(planning_units(batch, PAD, MIN_SHARED, budget=whole - 1)[1])
    units, costs = planning_units(batch, PAD, MIN_SHARED, budget=whole - 1)
    check_partition(units, 12)
    assert sorted(u.size for u in units) == [4, 4, 4]  # the three prompt groups
    budget = one_group - 1  # one prompt group does not fit: runs of members that do
    units, costs = planning_units(batch, PAD, MIN_SHARED, budget=budget)
    check_partition(units, 12)
    assert costs.max() <= budget and len(units) > 3
    for unit, cost in zip(units, costs, strict=True):
        assert engine_rows(batch, unit) == cost


@pytest.mark.parametrize(
    "change",
    [
        {"target_ids": "ids"},
        {"return_moe_metrics": True},  # metrics steps run dense: metrics_lead_rows 0
        {"routing": "routes"},
    ],
)
def test_what_the_engine_does_not_share_is_planned_sequence_by_sequence(change):
    rng = np.random.default_rng(3)
    batch = make_batch(grpo(rng, prompts=2, n=3, prompt_len=50, response_len=10))
    values = {
        "ids": np.zeros((batch.num_tokens, 1), np.int64),
        "routes": np.zeros((batch.num_tokens, 1, 1), np.int32),
    }
    batch = dataclasses.replace(batch, **{k: values.get(v, v) for k, v in change.items()})
    units, costs = planning_units(batch, PAD, MIN_SHARED, budget=100_000)
    assert [u.tolist() for u in units] == [[i] for i in range(6)]
    np.testing.assert_array_equal(costs, padded_lengths(batch.lengths, PAD))


@pytest.mark.parametrize("lead_rows", [1, 3])
def test_a_metrics_request_is_planned_with_the_lead_rows_of_its_steps(lead_rows):
    """A request with MoE / MTP metrics on an engine whose metrics steps share: units
    costed with the continuations' lead rows (1 + the MTP layers) as the engine cuts them."""
    rng = np.random.default_rng(7)
    system = rng.integers(1, 1000, 30).tolist()
    batch = make_batch(grpo(rng, prompts=2, n=4, prompt_len=60, response_len=20, prefix=system))
    batch = dataclasses.replace(batch, return_mtp_metrics=True)
    for pad in (1, PAD):
        units, costs = planning_units(batch, pad, MIN_SHARED, 100_000, metrics_lead_rows=lead_rows)
        assert len(units) == 1
        assert costs[0] == engine_rows(batch, units[0], pad, lead_rows=lead_rows)


def test_without_sharing_every_sequence_is_its_own_unit():
    rng = np.random.default_rng(4)
    batch = make_batch(grpo(rng, prompts=2, n=3, prompt_len=50, response_len=10))
    units, costs = planning_units(batch, PAD, 0, budget=100_000)
    assert [u.tolist() for u in units] == [[i] for i in range(6)]
    np.testing.assert_array_equal(costs, padded_lengths(batch.lengths, PAD))


def test_a_request_over_one_step_keeps_its_groups_whole():
    """A GRPO batch of 8 prompts x 8 at 1024 / 256 (~80k dense tokens) at a 32k budget:
    the first-fit over units puts whole groups in each step, none split across steps."""
    rng = np.random.default_rng(5)
    batch = make_batch(grpo(rng, prompts=8, n=8, prompt_len=1024, response_len=256))
    budget = 32_768
    units, costs = planning_units(batch, PAD, MIN_SHARED, budget)
    assert sorted(u.size for u in units) == [8] * 8
    remaining = list(np.argsort(-costs, kind="stable"))
    steps = 0
    while remaining:
        taken = fill_step([costs[remaining]], budget)[0]
        assert costs[[remaining[p] for p in taken]].sum() <= budget
        remaining = [r for p, r in enumerate(remaining) if p not in set(taken.tolist())]
        steps += 1
    dense = int(padded_lengths(batch.lengths, PAD).sum())
    assert steps == -(-int(costs.sum()) // budget) and dense > 2 * budget

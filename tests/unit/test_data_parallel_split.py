"""How a step's sequences are split across data-parallel ranks (no process group)."""

from __future__ import annotations

import numpy as np
import pytest

from megascore.api import layout
from megascore.api.types import ScoreBatch
from megascore.engine.layout.microbatch_plan import (
    plan_microbatches,
    shared_units,
    split_microbatches,
)
from megascore.engine.schedule.data_parallel import balanced_parts, split_step, sub_batch
from tests.prefix_groups import MIN_SHARED, prefix_group_batch


def test_parts_cover_every_sequence_once_in_caller_order():
    lengths = np.array([5, 300, 7, 120, 120, 1, 64, 9], dtype=np.int64)
    parts = balanced_parts(lengths, 3)
    assert sorted(np.concatenate(parts).tolist()) == list(range(lengths.size))
    assert all(np.array_equal(p, np.sort(p)) for p in parts)


def test_parts_balanced_by_tokens():
    """Longest first to the least loaded rank: no rank exceeds the mean by more than the
    longest sequence (the greedy bound); equal lengths split evenly."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2000, 200)
    for size in (2, 3, 8):
        loads = [int(lengths[p].sum()) for p in balanced_parts(lengths, size)]
        assert max(loads) - lengths.sum() / size <= lengths.max()
    equal = np.array([10, 10, 10, 10])
    assert [int(equal[p].sum()) for p in balanced_parts(equal, 2)] == [20, 20]


def test_more_ranks_than_sequences_leaves_empty_parts():
    split = split_step(np.array([3, 8]), 4, pad_multiple=1, microbatches=1)
    assert [p.tolist() for p in split.parts] == [[1], [0], [], []]
    assert [plan.ranges for plan in split.plans] == [[(0, 1)], [(0, 1)], [(0, 0)], [(0, 0)]]
    assert {plan.pad_to for plan in split.plans} == {8}


@pytest.mark.parametrize("pad_multiple", [1, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 3])
def test_microbatch_i_of_every_rank_is_the_lone_ranks_microbatch_i(pad_multiple, microbatches):
    """Same count and packed length on every DP rank; together their microbatch i holds
    the sequences one rank would put in its microbatch i (what keeps metrics equal)."""
    lengths = np.array([1, 5, 300, 1, 17, 3, 2, 40, 1, 9, 2, 120], dtype=np.int64)
    lone, _ = split_microbatches(lengths, pad_multiple, microbatches)
    split = split_step(lengths, 3, pad_multiple=pad_multiple, microbatches=microbatches)
    assert {len(plan.ranges) for plan in split.plans} == {len(lone)}
    (pad_to,) = {plan.pad_to for plan in split.plans}
    assert pad_to % pad_multiple == 0
    for i, (a, b) in enumerate(lone):
        together = []
        for part, plan in zip(split.parts, split.plans, strict=True):
            first, end = plan.ranges[i]
            together += part[first:end].tolist()
            assert layout.padded_lengths(lengths[part[first:end]], pad_multiple).sum() <= pad_to
        assert sorted(together) == list(range(a, b))
    for part, plan in zip(split.parts, split.plans, strict=True):
        assert np.array_equal(part, np.sort(part)) and plan.ranges[-1][1] == part.size


def test_sub_batch_takes_rows_of_every_per_token_and_per_sequence_field():
    lengths = np.array([2, 3, 1], dtype=np.int64)
    routing = np.arange(6 * 2 * 1).reshape(6, 2, 1)
    batch = ScoreBatch(
        token_ids=np.arange(6),
        lengths=lengths,
        loss_mask=np.array([1, 0, 1, 1, 0, 1], dtype=np.uint8),
        temperature=np.array([0.5, 1.0, 2.0], dtype=np.float32),
        top_k=3,
        routing=routing,
    )
    part = sub_batch(batch, np.array([0, 2]))
    assert part.token_ids.tolist() == [0, 1, 5]
    assert part.lengths.tolist() == [2, 1]
    assert part.loss_mask.tolist() == [1, 0, 1]
    assert part.temperature.tolist() == [0.5, 2.0]
    assert part.routing.tolist() == routing[[0, 1, 5]].tolist()
    assert part.top_k == 3
    empty = sub_batch(batch, np.array([], dtype=np.int64))
    assert empty.num_tokens == 0 and empty.num_sequences == 0 and empty.routing.shape == (0, 2, 1)


@pytest.mark.parametrize("microbatches", [1, 2, 3])
def test_a_shared_split_keeps_groups_whole_and_plans_them_shared(microbatches):
    """With prefix sharing the units are the groups sharing a prefix: every group goes
    whole to one DP rank, microbatch i of every rank together holds the groups of the
    lone rank's microbatch i, and the rank's plan of its part computes them shared
    within the common packed length."""
    batch = prefix_group_batch(seed=3)
    units = shared_units(
        batch.token_ids,
        batch.lengths,
        pad_multiple=4,
        min_shared=MIN_SHARED,
        labels=batch.temperatures(),
    )
    assert any(g.size > 1 for g in units.groups)
    lone, _ = plan_microbatches(
        batch.token_ids,
        batch.lengths,
        pad_multiple=4,
        count=microbatches,
        min_shared=MIN_SHARED,
        labels=batch.temperatures(),
    )
    split = split_step(batch.lengths, 2, pad_multiple=4, microbatches=microbatches, shared=units)
    (pad_to,) = {plan.pad_to for plan in split.plans}
    assert sorted(np.concatenate(split.parts).tolist()) == list(range(batch.num_sequences))
    owner = {int(s): rank for rank, part in enumerate(split.parts) for s in part}
    assert all(len({owner[int(s)] for s in g}) == 1 for g in units.groups)
    for i, mb in enumerate(lone):
        together = []
        for part, plan in zip(split.parts, split.plans, strict=True):
            assert plan.segments is not None and len(plan.ranges) == len(lone)
            first, end = plan.ranges[i]
            together += part[first:end].tolist()
        assert sorted(together) == sorted(mb.sequences.tolist())
    shared_microbatches = 0
    for part, plan in zip(split.parts, split.plans, strict=True):
        sub = sub_batch(batch, part)
        mbs, got_pad_to = plan_microbatches(
            sub.token_ids,
            sub.lengths,
            pad_multiple=4,
            count=microbatches,
            labels=sub.temperatures(),
            cuts=plan,
        )
        assert got_pad_to == pad_to
        for mb in mbs:
            rows = layout.padded_lengths(mb.segments.lengths, 4).sum()
            assert rows <= pad_to
            # the split's layout computes the part's own tokens: every token by a row of its id
            tokens = sub.token_ids[layout.token_index(sub.lengths, mb.sequences)]
            np.testing.assert_array_equal(mb.segments.token_ids[mb.segments.token_rows], tokens)
            held = set(part[mb.sequences].tolist())
            if any(g.size > 1 and set(g.tolist()) <= held for g in units.groups):
                # a group sharing a prefix is computed shared: fewer rows than its tokens
                assert mb.segments.token_ids.size < sub.lengths[mb.sequences].sum()
                shared_microbatches += 1
        seqs = np.concatenate([mb.sequences for mb in mbs])
        assert sorted(seqs.tolist()) == list(range(part.size))
    assert shared_microbatches >= 1
    assert (
        sum(layout.padded_lengths(mb.segments.lengths, 4).sum() for mb in lone)
        < layout.padded_lengths(batch.lengths, 4).sum()
    )

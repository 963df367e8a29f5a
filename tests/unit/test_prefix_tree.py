"""The segment tree of shared prefixes (engine.layout.prefix_tree) and the microbatch plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megascore.api import layout
from megascore.engine.layout.microbatch_plan import plan_microbatches
from megascore.engine.layout.prefix_tree import dense_layout, shared_groups, shared_layout
from megascore.engine.layout.segment_packing import pack_layout, prefix_rows
from tests.prefix_groups import MIN_SHARED, prefix_group_sequences


def _flat(seqs):
    return np.concatenate(seqs).astype(np.int64), np.array([len(s) for s in seqs], np.int64)


def check_layout(segments, seqs) -> None:
    """Every token is computed by a row holding its id, at its position, and predicted by
    the row before it in the same segment."""
    ids, lengths = _flat(seqs)
    seg_start = layout.offsets(segments.lengths)
    seg_of_row = np.repeat(np.arange(len(segments.lengths)), segments.lengths)
    row_pos = (
        segments.offsets[seg_of_row]
        + np.arange(len(segments.token_ids))
        - np.repeat(seg_start[:-1], segments.lengths)
    )
    np.testing.assert_array_equal(segments.token_ids, ids[segments.row_source])
    assert (segments.parents < np.arange(len(segments.parents))).all()  # parents first
    bounds = layout.offsets(lengths)
    for b, seq in enumerate(seqs):
        rows = segments.token_rows[bounds[b] : bounds[b + 1]]
        np.testing.assert_array_equal(segments.token_ids[rows], seq)
        np.testing.assert_array_equal(row_pos[rows], np.arange(len(seq)))
        np.testing.assert_array_equal(seg_of_row[rows[1:] - 1], seg_of_row[rows[1:]])


def test_random_groups_are_computed_once_and_keep_every_token():
    for seed in range(5):
        seqs, temps = prefix_group_sequences(seed)
        ids, lengths = _flat(seqs)
        segments = shared_layout(ids, lengths, min_shared=MIN_SHARED, labels=np.array(temps))
        check_layout(segments, seqs)
        assert segments.shared
        assert len(segments.token_ids) < 0.7 * len(ids)


def test_identical_sequences_and_a_whole_prefix_share_rows():
    p = np.arange(1, 21)
    seqs = [p, p.copy(), np.concatenate([p, [7]]), np.concatenate([p, [8, 9]])]
    segments = shared_layout(*_flat(seqs), min_shared=4)
    check_layout(segments, seqs)
    # the prompt once; the continuations [lead, 7] and [lead, 8, 9] at position 19
    assert segments.lengths.tolist() == [20, 2, 3]
    assert segments.parents.tolist() == [-1, 0, 0]
    assert segments.offsets.tolist() == [0, 19, 19]
    rows = segments.token_rows
    np.testing.assert_array_equal(rows[:20], rows[20:40])


def test_nested_prefixes_are_nested_segments():
    outer, inner = np.arange(1, 11), np.arange(50, 60)
    seqs = [
        np.concatenate([outer, inner, [1]]),
        np.concatenate([outer, inner, [2, 3]]),
        np.concatenate([outer, [4, 4, 4]]),
    ]
    segments = shared_layout(*_flat(seqs), min_shared=5)
    check_layout(segments, seqs)
    # (offset, length, parent's offset): the outer prompt, the inner prefix under it
    # (lead + 10), two continuations under the inner one, one under the outer one
    parent_offsets = [segments.offsets[p] if p >= 0 else -1 for p in segments.parents]
    shape = sorted(zip(segments.offsets, segments.lengths, parent_offsets, strict=True))
    assert [tuple(int(x) for x in row) for row in shape] == [
        (0, 10, -1),
        (9, 4, 0),
        (9, 11, 0),
        (19, 2, 9),
        (19, 3, 9),
    ]


@pytest.mark.parametrize("lead_rows", [2, 3])
def test_continuations_repeat_the_lead_rows_of_their_prefix(lead_rows):
    """A step running MTP layers repeats the prefix's last 1 + k tokens in each child; a
    child sees exactly the rows of the positions before its first (packed prefix rows)."""
    for seed in range(3):
        seqs, temps = prefix_group_sequences(seed)
        ids, lengths = _flat(seqs)
        segments = shared_layout(
            ids, lengths, min_shared=MIN_SHARED, labels=np.array(temps), lead_rows=lead_rows
        )
        check_layout(segments, seqs)
        one = shared_layout(ids, lengths, min_shared=MIN_SHARED, labels=np.array(temps))
        children = segments.parents >= 0
        np.testing.assert_array_equal(segments.lengths - one.lengths, (lead_rows - 1) * children)
        np.testing.assert_array_equal(one.offsets - segments.offsets, (lead_rows - 1) * children)
        packed = pack_layout(
            torch.from_numpy(segments.token_ids),
            segments,
            pad_multiple=4,
            pad_to=int(layout.padded_lengths(segments.lengths, 4).sum()),
            cp_rank=0,
            cp_size=1,
        )
        prefixes = prefix_rows(packed.packed_seq_params)
        for s, rows in enumerate(prefixes):
            seq = seqs[segments.sequences[s]]
            assert len(rows) == segments.offsets[s]
            np.testing.assert_array_equal(packed.input_ids[0, rows].numpy(), seq[: len(rows)])


def test_nothing_shared_is_the_dense_layout():
    seqs = [np.arange(1, 9), np.arange(1, 4), np.arange(2, 30)]  # n = 1; common prefix 3 < 4
    ids, lengths = _flat(seqs)
    segments = shared_layout(ids, lengths, min_shared=4)
    dense = dense_layout(ids, lengths)
    assert not segments.shared
    np.testing.assert_array_equal(segments.token_rows, dense.token_rows)
    np.testing.assert_array_equal(segments.lengths, dense.lengths)


@pytest.mark.parametrize("differ", ["labels", "keys"])
def test_labels_and_token_keys_keep_sequences_apart(differ):
    p = np.arange(1, 21)
    seqs = [np.concatenate([p, [1]]), np.concatenate([p, [2]])]
    ids, lengths = _flat(seqs)
    labels = np.array([1.0, 0.5]) if differ == "labels" else None
    keys = np.stack([ids, np.zeros_like(ids)], 1)
    if differ == "keys":
        keys[25, 1] = 3  # the second sequence's token 4 replays another route
    segments = shared_layout(ids, lengths, min_shared=4, token_keys=keys, labels=labels)
    check_layout(segments, seqs)
    if differ == "labels":
        assert not segments.shared
    else:  # shared up to the differing token only
        assert segments.lengths[0] == 4


def test_shared_groups_and_microbatch_plan_keep_groups_whole():
    seqs, temps = prefix_group_sequences(3)
    ids, lengths = _flat(seqs)
    labels = np.array(temps)
    groups = shared_groups(ids[:, None], lengths, labels, MIN_SHARED)
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(seqs)))
    plans, pad_to = plan_microbatches(
        ids, lengths, pad_multiple=4, count=4, min_shared=MIN_SHARED, labels=labels
    )
    _, dense_pad_to = plan_microbatches(ids, lengths, pad_multiple=4, count=4)
    assert len(plans) > 1 and pad_to < dense_pad_to
    for group in groups:  # every group in exactly one microbatch
        assert sum(np.isin(group, plan.sequences).any() for plan in plans) == 1
    for plan in plans:
        check_layout(plan.segments, [seqs[b] for b in plan.sequences])
        assert layout.padded_lengths(plan.segments.lengths, 4).sum() <= pad_to

"""Packing into the THD layout: NeMo-RL layout compatibility, CP sharding, round trips."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megascore.engine.layout.packing import (
    cp_shard_indices,
    pack_sequences,
    roll_within_segments,
    round_up_to_multiple,
)
from tests.padded_rows import flatten_rows, pack_rows

HAND_IDS = torch.tensor([[1, 2, 3, 0, 0], [4, 5, 0, 0, 0], [6, 7, 8, 9, 10]])


def _unpack(packed, cu_seqlens, cu_seqlens_padded, batch_size, seq_length):
    """``[1, T_padded, ...]`` -> ``[B, S, ...]``, sequence by sequence from its padded start."""
    out = packed.new_zeros((batch_size, seq_length, *packed.shape[2:]))
    for b in range(batch_size):
        start, n = int(cu_seqlens_padded[b]), int(cu_seqlens[b + 1] - cu_seqlens[b])
        out[b, :n] = packed[0, start : start + n]
    return out


def _nemo_rl_reference(ids, lengths, multiple, pad_to, cp_rank, cp_size):
    """NeMo-RL's per-sequence loop, restated plainly (valid inputs only)."""
    full, shard, running = [], [], 0
    for b, length in enumerate(lengths):
        padded = -(-length // multiple) * multiple
        if b == len(lengths) - 1 and pad_to is not None:
            padded = pad_to - running
        running += padded
        seq = torch.nn.functional.pad(ids[b, :length], (0, padded - length), value=0)
        full.append(seq)
        if cp_size > 1:
            chunk = padded // (2 * cp_size)
            seq = torch.cat(
                [
                    seq[cp_rank * chunk : (cp_rank + 1) * chunk],
                    seq[(2 * cp_size - 1 - cp_rank) * chunk : (2 * cp_size - cp_rank) * chunk],
                ]
            )
        shard.append(seq)
    return torch.cat(full).unsqueeze(0), torch.cat(shard).unsqueeze(0)


@st.composite
def packing_cases(draw):
    cp_size = draw(st.sampled_from([1, 2, 3]))
    multiple = 2 * cp_size * draw(st.integers(1, 3)) if cp_size > 1 else draw(st.integers(1, 5))
    batch = draw(st.integers(1, 5))
    row = draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(0, row), min_size=batch, max_size=batch))
    if sum(lengths) == 0:
        lengths[draw(st.integers(0, batch - 1))] = draw(st.integers(1, row))
    natural = sum(round_up_to_multiple(n, multiple) for n in lengths)
    step = 2 * cp_size if cp_size > 1 else 1
    pad_to = draw(st.one_of(st.none(), st.integers(0, 3).map(lambda k: natural + k * step)))
    seed = draw(st.integers(0, 2**16))
    ids = torch.randint(1, 1000, (batch, row), generator=torch.Generator().manual_seed(seed))
    return ids, lengths, multiple, pad_to, cp_size


def test_round_up_to_multiple():
    assert [round_up_to_multiple(v, 4) for v in (0, 1, 4, 5, 8)] == [0, 4, 4, 8, 8]
    assert round_up_to_multiple(7, 1) == 7
    with pytest.raises(ValueError, match="multiple"):
        round_up_to_multiple(3, 0)


def test_hand_worked_layout_with_cp():
    shards = [
        pack_rows(
            HAND_IDS,
            [3, 2, 5],
            pad_individual_seqs_to_multiple_of=4,
            pad_packed_seq_to=16,
            cp_rank=rank,
            cp_size=2,
        )
        for rank in (0, 1)
    ]
    p = shards[0]
    expected = [1, 2, 3, 0, 4, 5, 0, 0, 6, 7, 8, 9, 10, 0, 0, 0]
    assert p.input_ids.tolist() == [expected]
    assert p.cu_seqlens.tolist() == [0, 3, 5, 10] and p.cu_seqlens.dtype == torch.int32
    assert p.cu_seqlens_padded.tolist() == [0, 4, 8, 16]
    assert p.cu_seqlens_padded.dtype == torch.int32
    # Segments [0,4) [4,8) [8,16) cut in 4 chunks each; rank r keeps chunks r and 3 - r.
    assert shards[0].input_ids_cp_sharded.tolist() == [[1, 0, 4, 0, 6, 7, 0, 0]]
    assert shards[1].input_ids_cp_sharded.tolist() == [[2, 3, 5, 0, 8, 9, 10, 0]]
    params = p.packed_seq_params
    assert params.qkv_format == "thd"
    for cu in (
        params.cu_seqlens_q,
        params.cu_seqlens_kv,
        params.cu_seqlens_q_padded,
        params.cu_seqlens_kv_padded,
    ):
        assert cu.tolist() == [0, 4, 8, 16]
    assert params.max_seqlen_q == params.max_seqlen_kv == 8


def test_no_padding_keeps_real_boundaries():
    p = pack_rows(HAND_IDS, torch.tensor([3, 2, 5]))
    assert p.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    assert torch.equal(p.input_ids_cp_sharded, p.input_ids)
    assert p.cu_seqlens.tolist() == p.cu_seqlens_padded.tolist() == [0, 3, 5, 10]
    assert p.packed_seq_params.max_seqlen_q == 5
    assert p.packed_seq_params.total_tokens == 10


def test_pad_packed_seq_to_extends_last_segment_without_individual_padding():
    p = pack_rows(HAND_IDS, [3, 2, 5], pad_packed_seq_to=13)
    assert p.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 0, 0]]
    assert p.cu_seqlens_padded.tolist() == [0, 3, 5, 13]
    assert p.packed_seq_params.max_seqlen_q == 8


def test_pad_segment_puts_the_padding_in_a_segment_of_its_own():
    p = pack_rows(HAND_IDS, [3, 2, 5], pad_packed_seq_to=13, pad_segment=True)
    assert p.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 0, 0]]
    assert p.cu_seqlens.tolist() == [0, 3, 5, 10, 10]
    assert p.cu_seqlens_padded.tolist() == [0, 3, 5, 10, 13]
    assert p.packed_seq_params.cu_seqlens_q.tolist() == [0, 3, 5, 10, 13]
    assert p.packed_seq_params.max_seqlen_q == 5
    assert p.token_positions.tolist() == list(range(10))
    # no padding to add: the same layout as without the option
    same = pack_rows(HAND_IDS, [3, 2, 5], pad_packed_seq_to=10, pad_segment=True)
    assert same.cu_seqlens_padded.tolist() == [0, 3, 5, 10]
    # with CP the tail segment is sharded like any other (a multiple of 2 * cp)
    shards = [
        pack_rows(
            HAND_IDS,
            [3, 2, 5],
            pad_individual_seqs_to_multiple_of=4,
            pad_packed_seq_to=20,
            cp_rank=rank,
            cp_size=2,
            pad_segment=True,
        )
        for rank in (0, 1)
    ]
    assert shards[0].cu_seqlens_padded.tolist() == [0, 4, 8, 16, 20]
    assert shards[0].input_ids_cp_sharded.tolist() == [[1, 0, 4, 0, 6, 7, 0, 0, 0, 0]]
    assert shards[1].input_ids_cp_sharded.tolist() == [[2, 3, 5, 0, 8, 9, 10, 0, 0, 0]]


def test_zero_length_sequence_occupies_no_tokens():
    p = pack_rows(HAND_IDS, [3, 0, 5], pad_individual_seqs_to_multiple_of=4)
    assert p.cu_seqlens.tolist() == [0, 3, 3, 8]
    assert p.cu_seqlens_padded.tolist() == [0, 4, 4, 12]
    out = _unpack(p.input_ids, p.cu_seqlens, p.cu_seqlens_padded, 3, 5)
    assert out.tolist() == [[1, 2, 3, 0, 0], [0, 0, 0, 0, 0], [6, 7, 8, 9, 10]]


def test_roll_within_segments_builds_next_token_targets():
    p = pack_rows(HAND_IDS, [3, 2, 5], pad_individual_seqs_to_multiple_of=4)
    rolled = roll_within_segments(p.input_ids, p.cu_seqlens_padded)
    assert rolled.tolist() == [[2, 3, 0, 1, 5, 0, 0, 4, 7, 8, 9, 10, 0, 0, 0, 6]]
    back = roll_within_segments(rolled, p.cu_seqlens_padded, shifts=1)
    assert torch.equal(back, p.input_ids)


@pytest.mark.parametrize(
    ("lengths", "kwargs", "message"),
    [
        (
            [3, 2, 5],
            {"cp_size": 2, "cp_rank": 2, "pad_individual_seqs_to_multiple_of": 4},
            "cp_rank",
        ),
        (
            [3, 2, 5],
            {"cp_size": 2, "cp_rank": -1, "pad_individual_seqs_to_multiple_of": 4},
            "cp_rank",
        ),
        ([3, 2, 5], {"cp_size": 2, "pad_individual_seqs_to_multiple_of": 2}, "multiple of 2 \\*"),
        ([3, 2, 5], {"pad_packed_seq_to": 9}, "smaller than the packed length 10"),
        (
            [3, 2, 5],
            {"cp_size": 2, "pad_individual_seqs_to_multiple_of": 4, "pad_packed_seq_to": 18},
            "sequence 2: pad_packed_seq_to",
        ),
        ([3, 2, 5], {"pad_individual_seqs_to_multiple_of": 0}, "must be >= 1"),
    ],
)
def test_pack_rejects_what_nemo_rl_truncates(lengths, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pack_rows(HAND_IDS, lengths, **kwargs)


def test_pack_rejects_a_batch_that_is_not_flat():
    with pytest.raises(ValueError, match=r"\[T\]"):
        pack_sequences(torch.arange(4).reshape(1, 4), [4])


def test_token_positions_index_the_flat_tokens():
    p = pack_rows(HAND_IDS, [3, 0, 5], pad_individual_seqs_to_multiple_of=4)
    assert p.token_positions.tolist() == [0, 1, 2, 4, 5, 6, 7, 8]
    flat = flatten_rows(HAND_IDS, [3, 0, 5])
    assert torch.equal(p.input_ids[0, p.token_positions], flat)


def test_cp_shard_indices_names_the_indivisible_sequence():
    with pytest.raises(ValueError, match="sequence 1: padded length 6"):
        cp_shard_indices(torch.tensor([0, 4, 10]), 0, 2)
    with pytest.raises(ValueError, match="cp_rank"):
        cp_shard_indices(torch.tensor([0, 4]), 1, 1)
    assert cp_shard_indices(torch.tensor([0, 3, 5]), 0, 1).tolist() == [0, 1, 2, 3, 4]


@settings(max_examples=60, deadline=None)
@given(packing_cases())
def test_pack_matches_nemo_rl_layout_on_every_rank(case):
    ids, lengths, multiple, pad_to, cp_size = case
    for rank in range(cp_size):
        p = pack_rows(
            ids,
            lengths,
            pad_individual_seqs_to_multiple_of=multiple,
            pad_packed_seq_to=pad_to,
            cp_rank=rank,
            cp_size=cp_size,
        )
        full, shard = _nemo_rl_reference(ids, lengths, multiple, pad_to, rank, cp_size)
        assert torch.equal(p.input_ids, full)
        assert torch.equal(p.input_ids_cp_sharded, shard)
        assert p.input_ids_cp_sharded.shape[1] * cp_size == p.input_ids.shape[1]
        assert int(p.cu_seqlens[-1]) == sum(lengths)
        assert int(p.cu_seqlens_padded[-1]) == p.input_ids.shape[1]
        seg = p.cu_seqlens_padded[1:] - p.cu_seqlens_padded[:-1]
        assert p.packed_seq_params.max_seqlen_q == int(seg.max())


@settings(max_examples=60, deadline=None)
@given(packing_cases())
def test_packed_segments_hold_each_sequence(case):
    ids, lengths, multiple, pad_to, cp_size = case
    p = pack_rows(
        ids, lengths, pad_individual_seqs_to_multiple_of=multiple, pad_packed_seq_to=pad_to
    )
    out = _unpack(p.input_ids, p.cu_seqlens, p.cu_seqlens_padded, *ids.shape)
    keep = torch.arange(ids.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    assert torch.equal(out, torch.where(keep, ids, 0))


@settings(max_examples=60, deadline=None)
@given(packing_cases())
def test_cp_shards_reassemble_to_full(case):
    ids, lengths, multiple, pad_to, cp_size = case
    kwargs = {"pad_individual_seqs_to_multiple_of": multiple, "pad_packed_seq_to": pad_to}
    full = pack_rows(ids, lengths, **kwargs).input_ids
    rebuilt = torch.full_like(full, -1)
    seen = []
    for rank in range(cp_size):
        p = pack_rows(ids, lengths, cp_rank=rank, cp_size=cp_size, **kwargs)
        idx = cp_shard_indices(p.cu_seqlens_padded, rank, cp_size)
        rebuilt[:, idx] = p.input_ids_cp_sharded
        seen.append(idx)
    assert torch.equal(rebuilt, full)
    assert torch.equal(torch.sort(torch.cat(seen)).values, torch.arange(full.shape[1]))


@settings(max_examples=60, deadline=None)
@given(packing_cases(), st.integers(-3, 3))
def test_roll_within_segments_matches_per_segment_roll(case, shifts):
    ids, lengths, multiple, pad_to, _ = case
    p = pack_rows(
        ids, lengths, pad_individual_seqs_to_multiple_of=multiple, pad_packed_seq_to=pad_to
    )
    cu = p.cu_seqlens_padded.tolist()
    expected = torch.cat(
        [
            torch.roll(p.input_ids[:, s:e], shifts, dims=1)
            for s, e in zip(cu[:-1], cu[1:], strict=True)
        ],
        dim=1,
    )
    assert torch.equal(roll_within_segments(p.input_ids, p.cu_seqlens_padded, shifts), expected)
    # Next-token targets: real position t < len - 1 of sequence b targets ids[b, t + 1].
    targets = _unpack(
        roll_within_segments(p.input_ids, p.cu_seqlens_padded),
        p.cu_seqlens,
        p.cu_seqlens_padded,
        *ids.shape,
    )
    for b, n in enumerate(lengths):
        assert torch.equal(targets[b, : max(n - 1, 0)], ids[b, 1:n])

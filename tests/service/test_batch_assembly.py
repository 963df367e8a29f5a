"""Step planning (first-fit decreasing, merging) and the response codec, on the fake engine."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megascore.api.selection import concat_outputs, select_sequences
from megascore.api.types import ScoreBatch
from megascore.v1 import scoring_pb2 as pb
from megascore_server.batch_assembly import fill_step, merge_batches
from megascore_server.convert import build_response
from tests.service.fake_engine import compute


def naive_first_fit(candidates: list[list[int]], budget: int) -> list[list[int]]:
    """Reference: head's first sequence, then a one-by-one scan, longest first."""
    taken = [[] for _ in candidates]
    taken[0].append(0)
    room = budget - candidates[0][0]
    items = [(length, r, p) for r, c in enumerate(candidates) for p, length in enumerate(c)]
    items = [it for it in items if (it[1], it[2]) != (0, 0)]
    items.sort(key=lambda it: -it[0])  # stable: older request first among equals
    for length, r, p in items:
        if length <= room:
            taken[r].append(p)
            room -= length
    return [sorted(t) for t in taken]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(1, 40), min_size=1, max_size=8).map(lambda c: sorted(c, reverse=True)),
        min_size=1,
        max_size=6,
    ),
    st.integers(40, 120),
)
def test_fill_step_is_first_fit_decreasing(candidates, budget):
    got = fill_step([np.array(c, dtype=np.int64) for c in candidates], budget)
    assert [g.tolist() for g in got] == naive_first_fit(candidates, budget)
    used = sum(int(np.array(c)[g].sum()) for c, g in zip(candidates, got, strict=True))
    assert used <= budget


def test_fill_step_head_first_and_errors():
    # The head's long sequence goes first even though later requests are longer in total.
    got = fill_step([np.array([5]), np.array([9, 9, 9])], 10)
    assert [g.tolist() for g in got] == [[0], []]
    with pytest.raises(ValueError, match="exceeds the step budget"):
        fill_step([np.array([11])], 10)


def make_batch(seqs, *, top_k=0, losses=(), temperature=1.0, mask=None, logprobs=True):
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    return ScoreBatch(
        token_ids=np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs]),
        lengths=lengths,
        loss_mask=None if mask is None else np.concatenate(mask).astype(np.uint8),
        temperature=np.full(lengths.size, temperature, dtype=np.float32),
        top_k=top_k,
        losses=losses,
        return_logprobs=logprobs,
    )


def test_merge_select_concat_round_trip():
    a = make_batch([[1, 2, 3], [4, 5], [6]], top_k=2, losses=("nll",), temperature=0.5)
    b = make_batch([[7, 8, 9, 10], [11]], top_k=4, losses=("mean_nll",), mask=[[1, 0, 1, 1], [1]])
    c = make_batch([[12, 13]], logprobs=False)
    pieces = [(a, np.array([2, 0])), (b, np.array([0, 1])), (c, np.array([0])), (a, np.array([1]))]
    step = merge_batches(pieces)
    assert step.top_k == 4 and step.losses == ("nll", "mean_nll") and step.return_logprobs
    np.testing.assert_array_equal(step.lengths, [1, 3, 4, 1, 2, 2])
    np.testing.assert_array_equal(step.temperature, [0.5, 0.5, 1, 1, 1, 0.5])
    np.testing.assert_array_equal(step.loss_mask, [1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1])
    out = compute(step)
    # Request a: its sequences were in the step at positions 0, 1 (idx 2, 0) and 5 (idx 1).
    parts = [
        (
            np.array([2, 0]),
            select_sequences(out, step.lengths, np.array([0, 1]), a),
        ),
        (
            np.array([1]),
            select_sequences(out, step.lengths, np.array([5]), a),
        ),
    ]
    joined = concat_outputs(parts, a.lengths)
    alone = compute(a)
    np.testing.assert_array_equal(joined.logprobs, alone.logprobs)
    np.testing.assert_array_equal(joined.top_k_ids, alone.top_k_ids)
    np.testing.assert_array_equal(joined.top_k_logprobs, alone.top_k_logprobs)
    np.testing.assert_allclose(joined.losses["nll"], alone.losses["nll"], rtol=1e-12)
    np.testing.assert_array_equal(joined.num_loss_tokens, alone.num_loss_tokens)
    assert set(joined.losses) == {"nll"}


def test_response_encodes_the_output_as_it_is():
    batch = make_batch([[1, 2, 3], [4, 5]], mask=[[1, 0, 0], [1, 1]], top_k=1, losses=("nll",))
    out = compute(batch)
    out.num_loss_tokens = np.array([7, 9])  # the codec encodes, it does not recompute
    response = build_response("r", batch, out, pb.Timings(num_steps=1))
    assert response.top_k == 1 and list(response.sequence_losses) == ["nll"]
    assert np.frombuffer(response.num_loss_tokens.data, "<i8").tolist() == [7, 9]
    assert not response.moe_metrics and not response.mtp_metrics

"""The flat token layout: offsets, ranges, token index, loss-token counts, batch checks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megascore.api import layout
from megascore.api.errors import InvalidRequestError
from megascore.api.limits import Limits
from megascore.api.types import ScoreBatch


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=8), st.data())
def test_offsets_ranges_and_token_index_match_python_slicing(lengths, data):
    lengths = np.array(lengths, dtype=np.int64)
    seqs = [list(range(100 * b, 100 * b + n)) for b, n in enumerate(lengths)]
    flat = np.array([t for s in seqs for t in s], dtype=np.int64)
    bounds = layout.offsets(lengths)
    assert bounds.dtype == np.int64 and bounds.tolist() == [0, *np.cumsum(lengths).tolist()]
    starts = np.array(
        data.draw(st.lists(st.integers(-5, 50), min_size=lengths.size, max_size=lengths.size)),
        dtype=np.int64,
    )
    want = [v for s, n in zip(starts, lengths, strict=True) for v in range(s, s + n)]
    assert layout.ranges(starts, lengths).tolist() == want
    idx = np.array(data.draw(st.permutations(range(lengths.size))), dtype=np.int64)
    idx = idx[: data.draw(st.integers(0, lengths.size))]
    assert flat[layout.token_index(lengths, idx)].tolist() == [t for i in idx for t in seqs[i]]
    for position in range(flat.size):
        b = layout.sequence_at(bounds, position)
        assert flat[position] in seqs[b]


def test_token_index_is_a_slice_for_consecutive_sequences():
    lengths = np.array([2, 3, 1, 4])
    assert layout.token_index(lengths, np.array([1, 2])) == slice(2, 6)
    np.testing.assert_array_equal(layout.token_index(lengths, np.array([3, 0])), [6, 7, 8, 9, 0, 1])


def test_padded_lengths():
    np.testing.assert_array_equal(layout.padded_lengths(np.array([1, 4, 5]), 4), [4, 4, 8])
    np.testing.assert_array_equal(layout.padded_lengths(np.array([1, 4, 5]), 1), [1, 4, 5])


def test_loss_tokens_count_masked_positions_after_the_first():
    lengths = np.array([3, 2, 1])
    mask = np.array([1, 0, 0, 1, 1, 1], np.uint8)
    np.testing.assert_array_equal(layout.effective_loss_mask(lengths, mask), [0, 0, 0, 0, 1, 0])
    counts = layout.count_loss_tokens(lengths, mask)
    assert counts.dtype == np.int64 and counts.tolist() == [0, 1, 0]
    assert layout.count_loss_tokens(lengths, None).tolist() == [2, 1, 0]
    with pytest.raises(ValueError, match="6 entries"):
        layout.effective_loss_mask(lengths, np.ones(5, np.uint8))


LIMITS = Limits(vocab_size=10, max_sequence_length=3, max_top_k=4, loss_names=("mean_nll", "nll"))


def _batch(**kw) -> ScoreBatch:
    base = dict(token_ids=np.array([1, 2, 3, 4]), lengths=np.array([1, 3]))
    return ScoreBatch(**{**base, **kw})


def test_check_accepts_and_rejects_naming_the_field():
    _batch(top_k=4, losses=("nll",), temperature=np.array([0.5, 2.0], np.float32)).check(LIMITS)
    for bad, match in (
        (_batch(token_ids=np.array([1, 2, 3, 10])), "token_ids: sequence 1 position 2"),
        (_batch(token_ids=np.array([-1, 2, 3, 4])), "token_ids: sequence 0 position 0"),
        (_batch(lengths=np.array([2, 3])), "lengths sum"),
        (_batch(token_ids=np.arange(5), lengths=np.array([1, 4])), "sequence 1 has length 4"),
        (_batch(lengths=np.array([0, 4])), "sequence 0"),
        (_batch(lengths=np.array([], np.int64), token_ids=np.array([], np.int64)), "empty batch"),
        (_batch(top_k=5), "top_k"),
        (_batch(losses=("nope",)), "options.losses.*unknown loss"),
        (_batch(temperature=np.array([1.0, np.inf], np.float32)), "temperature"),
        (_batch(temperature=np.array([1.0], np.float32)), "temperature"),
        (_batch(loss_mask=np.ones(3, np.uint8)), "loss_mask"),
    ):
        with pytest.raises(InvalidRequestError, match=match):
            bad.check(LIMITS)
    no_metrics = Limits(**{**LIMITS.__dict__, "metrics_supported": False})
    _batch().check(no_metrics)
    with pytest.raises(InvalidRequestError, match="sequence_parallel"):
        _batch(return_mtp_metrics=True).check(no_metrics)

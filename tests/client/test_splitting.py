"""Automatic splitting of large batches under the message and token limits."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from megascore_client import InvalidInputError, ScoringClient, ScoringError
from megascore_client.batching import ScoreOptions, plan
from megascore_client.inputs import make_batch
from tests.client.fake_server import (
    FakeScorer,
    FakeServer,
    ref_logprobs,
    ref_moe,
    ref_mtp,
    ref_nll,
    ref_top_k,
)

LIMIT = 64 * 1024


def _batch(seed: int, count: int, low: int, high: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, size=int(n)) for n in rng.integers(low, high, size=count)]


@pytest.fixture
def small_server():
    """Server that itself refuses messages over LIMIT: a bad size estimate fails the test."""
    with FakeServer(FakeScorer(), max_message_bytes=LIMIT) as srv:
        yield srv


def test_large_batch_is_split_and_reassembled_in_order(small_server):
    seqs = _batch(0, 300, 10, 200)
    masks = [np.arange(len(s)) % 3 != 0 for s in seqs]
    with ScoringClient(small_server.target, max_message_bytes=LIMIT, max_concurrency=3) as c:
        result = c.score(
            seqs, loss_mask=masks, top_k=4, metrics=("moe", "mtp"), request_id="big", timeout=30
        )
    requests = small_server.scorer.requests
    assert len(requests) == result.timings.num_requests > 5
    assert sorted(r["request_id"] for r in requests) == sorted(
        f"big/{i}" for i in range(len(requests))
    )
    assert all(r["byte_size"] < LIMIT for r in requests)
    assert sum(r["num_sequences"] for r in requests) == 300
    assert result.request_id == "big" and len(result) == 300
    assert result.lengths.tolist() == [len(s) for s in seqs]
    for i, seq in enumerate(seqs):
        np.testing.assert_array_equal(result.logprobs[i], ref_logprobs(seq))
        np.testing.assert_array_equal(result.top_k_ids[i], ref_top_k(seq, 4)[0])
    np.testing.assert_allclose(
        result.loss["nll"], [ref_nll(s, m) for s, m in zip(seqs, masks, strict=True)]
    )
    # Token-weighted mean of per-request means == the mean over the whole batch.
    flat = np.concatenate(seqs)
    assert result.moe_metrics == pytest.approx(ref_moe(flat))
    assert result.mtp_metrics == pytest.approx(ref_mtp(flat))
    assert result.timings.compute_ms == pytest.approx(2.0 * len(requests))


def test_auto_token_limit_from_model_info():
    with FakeServer(FakeScorer(max_request_tokens=500)) as srv:
        seqs = _batch(1, 40, 20, 120)
        with ScoringClient(srv.target) as c:
            first = c.score(seqs)
            second = c.score(seqs[:3])
        assert srv.scorer.calls["GetModelInfo"] == 1
        assert all(r["num_tokens"] <= 500 for r in srv.scorer.requests)
        assert first.timings.num_requests > 1 and second.timings.num_requests == 1
        for got, seq in zip(first.logprobs, seqs, strict=True):
            np.testing.assert_array_equal(got, ref_logprobs(seq))
        with ScoringClient(srv.target, max_request_tokens=None) as c:
            with pytest.raises(ScoringError) as info:
                c.score(seqs)
            assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_sequence_over_the_limit_is_rejected_locally(small_server):
    with ScoringClient(small_server.target, max_message_bytes=LIMIT) as c:
        with pytest.raises(InvalidInputError) as info:
            c.score([[1, 2], list(range(1, 512)) * 10], top_k=8)
    assert "sequences[1]" in info.value.details and "response bytes" in info.value.details
    assert small_server.scorer.calls["Score"] == 0


def test_plan_ranges_are_consecutive_and_within_limits():
    seqs = _batch(2, 500, 1, 300)
    batch = make_batch(seqs, loss_mask=[np.ones(len(s), dtype=bool) for s in seqs])
    options = ScoreOptions(top_k=2, losses=("nll", "mean_nll"))
    ranges = plan(batch, options, max_message_bytes=LIMIT, max_request_tokens=3000)
    assert ranges[0][0] == 0 and ranges[-1][1] == 500
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    for start, stop in ranges:
        tokens = int(batch.lengths[start:stop].sum())
        assert tokens <= 3000 and tokens * (4 + 12 * 2) < LIMIT
    assert plan(batch, options, max_message_bytes=1 << 30) == [(0, 500)]

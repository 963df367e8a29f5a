"""The sync streaming helper (one ScoreStream bidi call, futures in order)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from megascore_client import InvalidInputError, ScoringClient, ScoringError
from tests.client.fake_server import (
    VOCAB,
    FakeScorer,
    FakeServer,
    ref_logprobs,
    ref_nll,
    ref_routing,
)


def _batches(n: int) -> list[list[list[int]]]:
    return [[list(range(i, i + 5 + i % 4)), [i % VOCAB, (i * 7) % VOCAB]] for i in range(n)]


def test_stream_results_in_order_with_request_ids(server, client):
    batches = _batches(20)
    with client.stream() as stream:
        futures = [
            stream.submit(b, top_k=2, request_id=f"roll-{i}", temperature=0.5)
            for i, b in enumerate(batches)
        ]
        first = futures[0].result(timeout=10)
    assert first.request_id == "roll-0"
    for i, (batch, future) in enumerate(zip(batches, futures, strict=True)):
        result = future.result()
        assert result.request_id == f"roll-{i}" and result.top_k == 2
        for seq, got in zip(batch, result.logprobs, strict=True):
            np.testing.assert_array_equal(got, ref_logprobs(seq, 0.5))
    assert server.scorer.calls["ScoreStream"] == 1 and server.scorer.calls["Score"] == 0
    assert [r["request_id"] for r in server.scorer.requests] == [f"roll-{i}" for i in range(20)]


def test_stream_splits_large_batches():
    limit = 64 * 1024
    with FakeServer(FakeScorer(), max_message_bytes=limit) as srv:
        rng = np.random.default_rng(3)
        big = [rng.integers(0, VOCAB, size=300) for _ in range(100)]
        masks = [np.arange(300) > 100 for _ in big]
        with ScoringClient(srv.target, max_message_bytes=limit) as c, c.stream() as stream:
            small = stream.submit([[1, 2, 3]], request_id="small")
            large = stream.submit(big, loss_mask=masks, top_k=3, request_id="large")
            after = stream.submit([[4, 5]], request_id="after")
        result = large.result()
        assert result.timings.num_requests > 1 and len(result) == 100
        np.testing.assert_allclose(
            result.loss["nll"], [ref_nll(s, m) for s, m in zip(big, masks, strict=True)]
        )
        assert small.result().request_id == "small" and after.result().lengths.tolist() == [2]
        ids = [r["request_id"] for r in srv.scorer.requests]
        assert ids[0] == "small" and ids[-1] == "after" and ids[1] == "large/0"


def test_a_decoding_failure_fails_the_futures_instead_of_hanging(server, client, monkeypatch):
    """The reader thread's own failure (here: decoding raises) ends the stream with an
    INTERNAL error naming it; every outstanding future gets it, none waits forever."""
    from megascore_client import stream as stream_module

    def broken(response, part):
        raise AttributeError("no such field")

    monkeypatch.setattr(stream_module, "decode_part", broken)
    futures, refused = [], []
    with client.stream() as stream:
        for _ in range(3):  # a submit after the failure ended the stream raises it
            try:
                futures.append(stream.submit([[1, 2, 3]]))
            except ScoringError as exc:
                refused.append(exc)
    errors = list(refused)
    for future in futures:  # the first submit always goes out
        with pytest.raises(ScoringError) as info:
            future.result(timeout=10)
        errors.append(info.value)
    assert futures and len(errors) == 3
    for error in errors:
        assert error.code is grpc.StatusCode.INTERNAL
        assert "AttributeError: no such field" in error.details


def test_stream_failure_fails_outstanding_and_later_submits(server, client):
    with client.stream() as stream:
        ok = stream.submit([[1, 2, 3]])
        bad = stream.submit([[1, VOCAB + 1]])
        with pytest.raises(ScoringError) as info:
            bad.result(timeout=10)
        assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(ScoringError):
            stream.submit([[1, 2]])
    assert ok.result().lengths.tolist() == [3]


def test_stream_invalid_input_keeps_stream_usable(client):
    with client.stream() as stream:
        with pytest.raises(InvalidInputError):
            stream.submit([[]])
        assert stream.submit([[7, 8]]).result(timeout=10).lengths.tolist() == [2]
    with pytest.raises(RuntimeError):
        stream.submit([[1]])


def test_stream_cancelled_on_exception_in_block(server, client):
    server.scorer.delay_s = 0.5
    with pytest.raises(KeyError):
        with client.stream() as stream:
            future = stream.submit([[1, 2, 3]])
            raise KeyError("boom")
    with pytest.raises(ScoringError) as info:
        future.result(timeout=5)
    assert info.value.code is grpc.StatusCode.CANCELLED


def test_stream_sends_the_token():
    with FakeServer(FakeScorer(token="t")) as srv:
        with ScoringClient(srv.target, token="t") as c, c.stream() as stream:
            assert stream.submit([[1, 2]]).result(timeout=10).lengths.tolist() == [2]
        assert srv.scorer.metadata[-1]["authorization"] == "Bearer t"
        with ScoringClient(srv.target, max_request_tokens=None) as c, c.stream() as stream:
            with pytest.raises(ScoringError) as info:
                stream.submit([[1, 2]]).result(timeout=10)
            assert info.value.code is grpc.StatusCode.UNAUTHENTICATED


def test_stream_records_and_replays_routing(server, client):
    batches = _batches(4)
    with client.stream() as stream:
        own = [stream.submit(b, return_routing=True) for b in batches]
        own = [f.result(timeout=10) for f in own]
        given = [[r + 1 for r in result.routing] for result in own]
        replayed = [
            stream.submit(b, routing=g, return_routing=True)
            for b, g in zip(batches, given, strict=True)
        ]
        replayed = [f.result(timeout=10) for f in replayed]
    for batch, first, routes, again in zip(batches, own, given, replayed, strict=True):
        for seq, got, want, back in zip(batch, first.routing, routes, again.routing, strict=True):
            np.testing.assert_array_equal(got, ref_routing(seq))
            np.testing.assert_array_equal(back, want)
    sent = [r["routing"] for r in server.scorer.requests[len(batches) :]]
    for routes, flat in zip(given, sent, strict=True):
        np.testing.assert_array_equal(flat, np.concatenate(routes).reshape(-1))

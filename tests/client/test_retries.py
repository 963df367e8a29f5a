"""Retries through the channel's service config: UNAVAILABLE only, with backoff."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from megascore_client import RetryPolicy, ScoringClient, ScoringError
from tests.client.fake_server import FakeScorer, FakeServer, ref_logprobs

UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, "draining")
FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05)


def _client(server, **kwargs) -> ScoringClient:
    kwargs.setdefault("retries", FAST)
    return ScoringClient(server.target, timeout=10, max_request_tokens=None, **kwargs)


def test_unavailable_is_retried_even_for_large_requests(server):
    big = [np.arange(300_000) % 512]  # ~1.2 MB: beyond gRPC's default 256 KiB retry buffer
    server.scorer.fail_next += [UNAVAILABLE, UNAVAILABLE]
    with _client(server) as client:
        result = client.score(big)
    np.testing.assert_array_equal(result.logprobs[0], ref_logprobs(big[0]))
    assert server.scorer.calls["Score"] == 3


def test_invalid_argument_is_not_retried(server):
    server.scorer.fail_next.append((grpc.StatusCode.INVALID_ARGUMENT, "bad"))
    with _client(server) as client:
        with pytest.raises(ScoringError) as info:
            client.score([[1, 2, 3]])
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert server.scorer.calls["Score"] == 1


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_other_codes_are_not_retried(server, code):
    server.scorer.fail_next.append((code, "no"))
    with _client(server) as client:
        with pytest.raises(ScoringError) as info:
            client.score([[1, 2, 3]])
    assert info.value.code is code and server.scorer.calls["Score"] == 1


def test_a_refused_stream_is_not_replayed_by_grpc(server):
    """A ScoreStream refused UNAVAILABLE (a replica still loading) fails its outstanding
    futures at once: gRPC's replay of a bidi stream's pipelined messages is not trusted
    (it lost one in the 60-minute soak) and a lost message would fail the whole stream."""
    server.scorer.fail_next.append(UNAVAILABLE)
    errors, futures = [], []
    with _client(server) as client:
        with client.stream() as stream:
            for i in range(4):
                try:  # once the stream failed (it may before the first), submit raises
                    futures.append(stream.submit([[1, 2, 3 + i]]))
                except ScoringError as exc:
                    errors.append(exc)
            errors += [f.exception(timeout=10) for f in futures]
    assert len(errors) == 4  # each from submit or from its future
    assert {getattr(e, "code", None) for e in errors} == {grpc.StatusCode.UNAVAILABLE}
    assert server.scorer.calls["ScoreStream"] == 1


def test_attempts_are_bounded_and_retries_can_be_disabled(server):
    server.scorer.fail_next += [UNAVAILABLE] * 6
    with _client(server, retries=RetryPolicy(3, 0.01, 0.02)) as client:
        with pytest.raises(ScoringError) as info:
            client.score([[1, 2, 3]])
    assert info.value.code is grpc.StatusCode.UNAVAILABLE and info.value.retryable
    assert server.scorer.calls["Score"] == 3
    with _client(server, retries=None) as client:
        with pytest.raises(ScoringError):
            client.score([[1, 2, 3]])
    assert server.scorer.calls["Score"] == 4
    with _client(server, retries=None) as client:
        with pytest.raises(ScoringError):
            client.model_info()  # non-Score methods are covered by the same policy
    server.scorer.fail_next[:] = [UNAVAILABLE]
    with _client(server) as client:
        assert client.model_info().vocab_size == 512


def test_server_restart_on_the_same_port_mid_job():
    """A job keeps scoring while its server goes down and comes back on the same port."""
    scorer = FakeScorer()
    server = FakeServer(scorer).start()
    policy = RetryPolicy(max_attempts=5, initial_backoff_s=1.0, max_backoff_s=4.0)
    batches = [[list(range(i, i + 20)), list(range(3 * i, 3 * i + 7))] for i in range(6)]
    results = []
    restarter = None
    try:
        with ScoringClient(server.target, retries=policy, timeout=30) as client:
            for i, batch in enumerate(batches):
                if i == 3:
                    server.stop()
                    restarter = threading.Timer(0.3, server.start)
                    restarter.start()
                    down_at = time.monotonic()
                results.append(client.score(batch))
                if i == 3:
                    assert time.monotonic() - down_at >= 0.3  # it really waited for the restart
    finally:
        if restarter is not None:
            restarter.join()
        server.stop()
    assert len(results) == 6
    for batch, result in zip(batches, results, strict=True):
        for seq, got in zip(batch, result.logprobs, strict=True):
            np.testing.assert_array_equal(got, ref_logprobs(seq))
    assert scorer.calls["Score"] == 6

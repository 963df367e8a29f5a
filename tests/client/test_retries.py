"""Retries through the channel's service config: UNAVAILABLE and a CANCELLED the caller
did not ask for (a stopping server's grpc core), with backoff."""

from __future__ import annotations

import asyncio
import collections
import threading
import time

import grpc
import numpy as np
import pytest

from megascore_client import RetryPolicy, ScoringClient, ScoringError
from megascore_client.channel import ChannelSettings
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


def test_a_cancelled_answer_from_the_server_is_retried(server):
    server.scorer.fail_next += [(grpc.StatusCode.CANCELLED, "CANCELLED")]
    with _client(server) as client:
        result = client.score([[1, 2, 3]])
    np.testing.assert_array_equal(result.logprobs[0], ref_logprobs([1, 2, 3]))
    assert server.scorer.calls["Score"] == 2


class _RawServer:
    """A grpc.aio server on its own loop thread whose Score waits ``delay_s`` and
    answers empty bytes; counts the calls its handler saw."""

    def __init__(self, delay_s: float):
        self.delay_s, self.calls = delay_s, 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self.run(self._start())

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> int:
        async def score(request, context):
            self.calls += 1
            await asyncio.sleep(self.delay_s)
            return b""

        handler = grpc.method_handlers_generic_handler(
            "megascore.v1.Scorer", {"Score": grpc.unary_unary_rpc_method_handler(score)}
        )
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((handler,))
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def close(self) -> None:
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _raw_score(target: str, retries):
    settings = ChannelSettings.build(target, tls=None, retries=retries)
    channel = grpc.insecure_channel(target, options=settings.options())
    return channel, channel.unary_unary("/megascore.v1.Scorer/Score")


def test_calls_racing_a_server_shutdown_are_retried_not_cancelled():
    """The source of the soak's CANCELLED: grpc core cancels every call that reaches a
    server after its shutdown began and before the client read the GOAWAY (CANCELLED,
    details "CANCELLED", no handler runs). Clients without retries see it; the SDK's
    policy sends those calls again (here to a dead port: UNAVAILABLE), never CANCELLED."""
    codes = {False: collections.Counter(), True: collections.Counter()}  # by retried
    lock = threading.Lock()
    rounds = 0
    while codes[False]["CANCELLED"] == 0 and rounds < 40:
        rounds += 1
        server, stop = _RawServer(delay_s=0.001), threading.Event()

        def hammer(retried: bool, target=f"127.0.0.1:{server.port}", stop=stop):
            channel, score = _raw_score(target, FAST if retried else None)
            with channel:
                while not stop.is_set():
                    try:
                        score(b"", timeout=5)
                        code = "OK"
                    except grpc.RpcError as exc:
                        code = exc.code().name
                    with lock:
                        codes[retried][code] += 1

        threads = [threading.Thread(target=hammer, args=(i % 2 == 0,)) for i in range(8)]
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        server.run(server.server.stop(1.0))
        time.sleep(0.1)
        stop.set()
        for thread in threads:
            thread.join(30)
        server.close()
    assert codes[False]["CANCELLED"] > 0, (rounds, codes)  # the race was exercised
    assert codes[True]["CANCELLED"] == 0 and codes[True]["OK"] > 0, codes


def test_a_call_its_caller_cancels_is_not_sent_again():
    server = _RawServer(delay_s=1.0)
    try:
        channel, score = _raw_score(f"127.0.0.1:{server.port}", FAST)
        with channel:
            future = score.future(b"", timeout=10)
            deadline = time.monotonic() + 10
            while server.calls == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert future.cancel()
            time.sleep(0.5)  # more than FAST's whole backoff
            with pytest.raises(grpc.FutureCancelledError):
                future.result()
        assert server.calls == 1
        channel, score = _raw_score(f"127.0.0.1:{server.port}", FAST)
        with channel, pytest.raises(grpc.RpcError) as info:
            score(b"", timeout=0.3)  # its own deadline: DEADLINE_EXCEEDED, not re-sent
        assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED and server.calls == 2
    finally:
        server.close()


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

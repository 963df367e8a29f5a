"""``wait_for_server_s``: riding out a server that is down or answers UNAVAILABLE.

The fake server answers UNAVAILABLE a given number of times (``FakeScorer.fail_next``)
or is stopped and restarted on its port. gRPC's own retries are off (``retries=None``)
unless a test says otherwise, so every attempt the server sees is one the SDK sent, and
the SDK's backoff is shortened (``fast_backoff``) to keep the tests quick.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

import grpc
import numpy as np
import pytest

from megascore_client import AsyncScoringClient, RetryPolicy, ScoringClient, ScoringError, waiting
from tests.client.fake_server import VOCAB, FakeScorer, FakeServer, ref_logprobs

UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, "server is starting: model loading; retry later")
SEQS = [[1, 2, 3, 4], [7, 8, 9]]


@pytest.fixture
def fast_backoff(monkeypatch):
    """The SDK's wait backoff: 0.02 s doubling up to 0.1 s (instead of 0.5 s up to 5 s)."""
    monkeypatch.setattr(waiting, "INITIAL_BACKOFF_S", 0.02)
    monkeypatch.setattr(waiting, "MAX_BACKOFF_S", 0.1)


def sync_client(server, **kwargs) -> ScoringClient:
    kwargs.setdefault("retries", None)
    kwargs.setdefault("timeout", 30)
    return ScoringClient(server.target, max_request_tokens=None, **kwargs)


def async_client(server, **kwargs) -> AsyncScoringClient:
    kwargs.setdefault("retries", None)
    kwargs.setdefault("timeout", 30)
    return AsyncScoringClient(server.target, max_request_tokens=None, **kwargs)


def score(server, mode: str, sequences=SEQS, *, call_timeout=None, **kwargs):
    """Scores ``sequences`` with a new sync or asyncio client built with ``kwargs``."""
    if mode == "sync":
        with sync_client(server, **kwargs) as client:
            return client.score(sequences, timeout=call_timeout)

    async def main():
        async with async_client(server, **kwargs) as client:
            return await client.score(sequences, timeout=call_timeout)

    return asyncio.run(main())


def failed_score(server, mode: str, *, call_timeout=None, **kwargs) -> tuple[ScoringError, float]:
    """Like ``score`` for a call that must fail: its error and how long ``client.score``
    itself took (the client's set-up and close are not counted: a loaded machine can
    spend a good part of a second on them, and the call's timeout starts at the call)."""
    if mode == "sync":
        with sync_client(server, **kwargs) as client:
            begin = time.monotonic()
            with pytest.raises(ScoringError) as info:
                client.score(SEQS, timeout=call_timeout)
            return info.value, time.monotonic() - begin

    async def main():
        async with async_client(server, **kwargs) as client:
            begin = time.monotonic()
            with pytest.raises(ScoringError) as info:
                await client.score(SEQS, timeout=call_timeout)
            return info.value, time.monotonic() - begin

    return asyncio.run(main())


def assert_scored(result, sequences=SEQS):
    assert len(result) == len(sequences)
    for seq, got in zip(sequences, result.logprobs, strict=True):
        np.testing.assert_array_equal(got, ref_logprobs(seq))


# ------------------------------------------------------------------ the schedule itself


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_schedule_doubles_to_the_cap_with_jitter_and_ends_with_the_budget():
    clock = FakeClock()
    for rand, factor in ((lambda: 0.0, 0.8), (lambda: 0.5, 1.0), (lambda: 0.999999, 1.2)):
        clock.now = 100.0
        wait = waiting.ServerWait(20.0, None, clock=clock, rand=rand)
        delays = []
        while (delay := wait.next_delay()) is not None:
            delays.append(delay)
            clock.now += delay
        # 0.5, 1, 2, 4, 5, 5, ... jittered, the last one cut to end exactly with the budget
        nominal = [0.5, 1.0, 2.0, 4.0] + [5.0] * 10
        assert delays[:-1] == pytest.approx([factor * d for d in nominal[: len(delays) - 1]])
        assert 0 < delays[-1] <= factor * nominal[len(delays) - 1] + 1e-9
        assert sum(delays) == pytest.approx(20.0) and wait.resends == len(delays)
        error = wait.gave_up(ScoringError(grpc.StatusCode.UNAVAILABLE, "refused"))
        assert error.code is grpc.StatusCode.UNAVAILABLE
        assert error.details.startswith("refused [waited 20.0 s for the server")
        assert "wait_for_server_s=20 spent" in error.details


def test_schedule_stops_before_the_deadline():
    clock = FakeClock()
    wait = waiting.ServerWait(60.0, clock.now + 2.0, clock=clock, rand=lambda: 0.5)
    assert wait.next_delay() == pytest.approx(0.5)
    clock.now += 0.5
    assert wait.next_delay() == pytest.approx(1.0)  # re-sent 0.5 s before the deadline
    clock.now += 1.0
    assert wait.next_delay() is None  # 2 s from now is past the deadline
    assert (
        "timeout would pass" in wait.gave_up(ScoringError(grpc.StatusCode.UNAVAILABLE, "x")).details
    )


@pytest.mark.parametrize(
    ("wait", "timeout", "message"),
    [
        (-1.0, 30.0, ">= 0"),
        (float("nan"), 30.0, ">= 0"),
        (float("inf"), None, ">= 0"),
        (60.0, 60.0, "must exceed wait_for_server_s"),
        (120.0, 60.0, "must exceed wait_for_server_s"),
    ],
)
def test_bad_wait_settings_are_rejected(wait, timeout, message):
    for cls in (ScoringClient, AsyncScoringClient):
        with pytest.raises(ValueError, match=message):
            cls("127.0.0.1:1", wait_for_server_s=wait, timeout=timeout)


def test_wait_is_off_by_default_and_allowed_without_a_deadline():
    assert ScoringClient("127.0.0.1:1").wait_for_server_s == 0.0
    assert (
        ScoringClient("127.0.0.1:1", wait_for_server_s=600, timeout=None).wait_for_server_s == 600
    )


# ------------------------------------------------------------------ against the fake server


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_unavailable_answers_are_waited_out(server, fast_backoff, mode):
    server.scorer.fail_next += [UNAVAILABLE] * 4
    result = score(server, mode, wait_for_server_s=10)
    assert_scored(result)
    assert server.scorer.calls["Score"] == 5


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_without_the_option_unavailable_fails_fast(server, mode):
    server.scorer.fail_next += [UNAVAILABLE] * 4
    error, elapsed = failed_score(server, mode)
    assert elapsed < 2
    assert error.code is grpc.StatusCode.UNAVAILABLE and error.retryable
    assert error.details == UNAVAILABLE[1]  # as the server said it: nothing waited
    assert server.scorer.calls["Score"] == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_gives_up_when_the_wait_budget_is_spent(server, fast_backoff, mode):
    server.scorer.fail_next += [UNAVAILABLE] * 1000
    error, elapsed = failed_score(server, mode, wait_for_server_s=0.6)
    assert 0.6 <= elapsed < 3, elapsed
    assert error.code is grpc.StatusCode.UNAVAILABLE
    assert re.fullmatch(
        re.escape(UNAVAILABLE[1]) + r" \[waited \d+\.\d s for the server, \d+ re-sends; "
        r"gave up: wait_for_server_s=0.6 spent\]",
        error.details,
    ), error.details
    # 0.02, 0.04, 0.08, then 0.1 s apart (+-20 %) over 0.6 s: ~9 attempts (fewer when slow)
    assert 4 <= server.scorer.calls["Score"] <= 12


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_request_timeout_bounds_the_wait(server, mode):
    server.scorer.fail_next += [UNAVAILABLE] * 1000
    error, elapsed = failed_score(
        server, mode, wait_for_server_s=30, timeout=None, call_timeout=1.2
    )
    # re-sends after 0.5 s (+-20 %) then none: the next would start past the deadline
    assert 0.4 <= elapsed < 1.2, elapsed
    assert error.code is grpc.StatusCode.UNAVAILABLE  # not DEADLINE_EXCEEDED
    assert "timeout would pass" in error.details
    assert server.scorer.calls["Score"] == 2


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    ],
)
def test_other_codes_are_raised_at_once(server, fast_backoff, mode, code):
    server.scorer.fail_next += [UNAVAILABLE, (code, "no"), UNAVAILABLE]
    with pytest.raises(ScoringError) as info:
        score(server, mode, wait_for_server_s=10)
    assert info.value.code is code and info.value.details == "no"
    assert server.scorer.calls["Score"] == 2  # the UNAVAILABLE was re-sent, not this


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_each_part_of_a_split_batch_waits(fast_backoff, mode):
    limit = 64 * 1024
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(500, 2000, 60)]
    with FakeServer(FakeScorer(), max_message_bytes=limit) as srv:
        srv.scorer.fail_next += [UNAVAILABLE] * 5
        result = score(srv, mode, seqs, wait_for_server_s=10, max_message_bytes=limit)
        parts = result.timings.num_requests
        assert parts > 2
        assert srv.scorer.calls["Score"] == parts + 5
        assert len(srv.scorer.requests) == parts  # each part answered once
    assert_scored(result, seqs)


def test_model_info_waits_load_weights_and_health_do_not(server, fast_backoff):
    with sync_client(server, wait_for_server_s=10) as client:
        server.scorer.fail_next += [UNAVAILABLE] * 3
        assert client.model_info().vocab_size == VOCAB
        assert server.scorer.calls["GetModelInfo"] == 4
        server.scorer.fail_next += [UNAVAILABLE]
        with pytest.raises(ScoringError) as info:
            client.load_weights("hf:/ckpt", "w1")
        assert info.value.code is grpc.StatusCode.UNAVAILABLE
        assert server.scorer.calls["LoadWeights"] == 1 and server.scorer.weights_version == "v0"

    async def main():
        async with async_client(server, wait_for_server_s=10) as client:
            server.scorer.fail_next += [UNAVAILABLE] * 3
            assert (await client.model_info()).vocab_size == VOCAB
            server.scorer.fail_next += [UNAVAILABLE]
            with pytest.raises(ScoringError) as info:
                await client.load_weights("hf:/ckpt", "w1")
            return info.value

    error = asyncio.run(main())
    assert error.code is grpc.StatusCode.UNAVAILABLE
    assert server.scorer.calls["GetModelInfo"] == 8 and server.scorer.calls["LoadWeights"] == 2
    server.stop()  # health probes report, they do not wait
    with sync_client(server, wait_for_server_s=10) as client:
        begin = time.monotonic()
        with pytest.raises(ScoringError) as info:
            client.health(timeout=5)
        assert info.value.code is grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - begin < 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_job_survives_a_restart_longer_than_grpc_retries(mode):
    """The server goes away (connection refused), comes back on the same port after
    1.5 s and answers "model loading" twice: gRPC's retries (3 attempts, 0.05 s) are
    long spent, the SDK's wait carries the job through."""
    scorer = FakeScorer()
    server = FakeServer(scorer).start()
    batches = [[list(range(i, i + 20)), list(range(3 * i, 3 * i + 7))] for i in range(5)]
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.05)
    options = dict(retries=policy, wait_for_server_s=20, timeout=40)
    restarter: threading.Timer | None = None

    def restart():
        scorer.fail_next += [UNAVAILABLE] * 2
        server.start()

    def go_down():
        nonlocal restarter
        server.stop()
        restarter = threading.Timer(1.5, restart)
        restarter.start()
        return time.monotonic()

    results, spans = [], []
    try:
        if mode == "sync":
            with sync_client(server, **options) as client:
                for i, batch in enumerate(batches):
                    start = go_down() if i == 2 else time.monotonic()
                    results.append(client.score(batch))
                    spans.append(time.monotonic() - start)
        else:

            async def main():
                async with async_client(server, **options) as client:
                    for i, batch in enumerate(batches):
                        start = go_down() if i == 2 else time.monotonic()
                        results.append(await client.score(batch))
                        spans.append(time.monotonic() - start)

            asyncio.run(main())
    finally:
        if restarter is not None:
            restarter.join()
        server.stop()
    for batch, result in zip(batches, results, strict=True):
        assert_scored(result, batch)
    assert spans[2] >= 1.5  # the straddling call waited for the new server
    assert spans[2] < 1.5 + 5 + 3  # ... and was answered within a backoff of its return
    assert scorer.calls["Score"] == len(batches) + 2


def test_close_wakes_a_sync_request_waiting_for_the_server(server):
    server.scorer.fail_next += [UNAVAILABLE] * 1000
    client = sync_client(server, wait_for_server_s=60, timeout=None)
    errors: list[BaseException] = []

    def run():
        try:
            client.score(SEQS)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.3)
    begin = time.monotonic()
    client.close()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - begin < 2
    (error,) = errors
    assert isinstance(error, ScoringError) and error.code is grpc.StatusCode.CANCELLED


def test_close_wakes_an_async_request_waiting_for_the_server(server):
    server.scorer.fail_next += [UNAVAILABLE] * 1000

    async def main():
        client = async_client(server, wait_for_server_s=60, timeout=None)
        task = asyncio.ensure_future(client.score(SEQS))
        await asyncio.sleep(0.3)
        begin = time.monotonic()
        await client.close()
        with pytest.raises(ScoringError) as info:
            await asyncio.wait_for(task, 5)
        return info.value, time.monotonic() - begin

    error, elapsed = asyncio.run(main())
    assert error.code is grpc.StatusCode.CANCELLED and elapsed < 2


def test_calls_on_a_closed_client_raise_cancelled(server):
    """No call reaches a closed channel (grpcio 1.85 crashes the process on a sync one)."""
    client = sync_client(server)
    client.close()
    for call in (lambda: client.score(SEQS), client.model_info, client.health):
        with pytest.raises(ScoringError) as info:
            call()
        assert info.value.code is grpc.StatusCode.CANCELLED

    async def main():
        aclient = async_client(server)
        await aclient.close()
        for call in (lambda: aclient.score(SEQS), aclient.model_info, aclient.health):
            with pytest.raises(ScoringError) as info:
                await call()
            assert info.value.code is grpc.StatusCode.CANCELLED

    asyncio.run(main())
    assert server.scorer.calls["Score"] == 0

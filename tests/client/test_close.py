"""Closing a client: streams, ``wait_until_serving`` and calls in flight.

A closed client raises ``ScoringError(CANCELLED, "the client is closed")`` and sends
nothing (grpcio 1.85 crashes the process on a call through a closed sync channel).
The fake server's gate (``FakeScorer.gate``, also holding health checks) keeps calls
in flight while a test closes the client.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest

from megascore_client import AsyncScoringClient, ScoringClient, ScoringError
from tests.client.fake_server import VOCAB, FakeScorer, FakeServer

SEQS = [[1, 2, 3, 4], [7, 8, 9]]


@pytest.fixture
def held(server):
    """The server holds every call at its start until the test ends (or sets the gate)."""
    server.scorer.gate.clear()
    yield server
    server.scorer.gate.set()


def assert_closed(error: BaseException) -> None:
    assert type(error) is ScoringError
    assert error.code is grpc.StatusCode.CANCELLED
    assert error.details == "the client is closed"


def wait_for(condition, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


async def async_wait_for(condition, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


def sent(server) -> int:
    """Calls the server has seen so far (every method, health checks included)."""
    return sum(server.scorer.calls.values()) + server.health.checks


# ------------------------------------------------------------------ streams


def test_sync_stream_on_a_closed_client_raises_without_a_call(server):
    client = ScoringClient(server.target, max_request_tokens=None)
    client.close()
    with pytest.raises(ScoringError) as info:
        client.stream()
    assert_closed(info.value)
    with pytest.raises(ScoringError) as info:
        with client.stream():
            pass
    assert_closed(info.value)
    assert sent(server) == 0


def test_async_stream_on_a_closed_client_raises_without_a_call(server):
    async def main():
        client = AsyncScoringClient(server.target, max_request_tokens=None)
        await client.close()
        stream = client.stream()
        with pytest.raises(ScoringError) as info:
            async with stream:
                pass
        assert_closed(info.value)
        with pytest.raises(RuntimeError):  # never opened
            await stream.submit(SEQS)

    asyncio.run(main())
    assert sent(server) == 0


def test_close_fails_an_open_async_stream_with_the_closed_error(held):
    """close() cancels an open stream: its futures and later submits get the closed
    error (not a bare CancelledError), and leaving the block raises nothing."""

    async def main():
        client = AsyncScoringClient(held.target, max_request_tokens=None)
        async with client.stream() as stream:
            future = await stream.submit(SEQS)
            await async_wait_for(lambda: held.scorer.calls["ScoreStream"] == 1)
            await client.close()
            with pytest.raises(ScoringError) as info:
                await asyncio.wait_for(future, 5)
            assert_closed(info.value)
            with pytest.raises(ScoringError) as info:
                await stream.submit(SEQS)
            assert_closed(info.value)

    asyncio.run(main())
    held.scorer.gate.set()
    time.sleep(0.1)
    assert sum(held.scorer.calls.values()) == 1 and not held.scorer.requests


def test_an_exception_in_an_async_stream_block_propagates(held):
    """The block's exception cancels the stream and is raised as is (not replaced by
    the call's CancelledError); the futures fail with CANCELLED."""

    async def main():
        async with AsyncScoringClient(held.target, max_request_tokens=None) as client:
            with pytest.raises(KeyError):
                async with client.stream() as stream:
                    future = await stream.submit(SEQS)
                    raise KeyError("boom")
            with pytest.raises(ScoringError) as info:
                await asyncio.wait_for(future, 5)
            assert info.value.code is grpc.StatusCode.CANCELLED
            assert info.value.details == "the stream was cancelled"

    asyncio.run(main())


# ------------------------------------------------------------------ wait_until_serving


def test_sync_wait_until_serving_on_a_closed_client_raises_at_once(server):
    client = ScoringClient(server.target)
    client.close()
    begin = time.monotonic()
    with pytest.raises(ScoringError) as info:
        client.wait_until_serving(timeout=30, interval=0.05)
    assert time.monotonic() - begin < 5  # at once, not after the 30 s timeout
    assert_closed(info.value)
    assert sent(server) == 0


def test_async_wait_until_serving_on_a_closed_client_raises_at_once(server):
    async def main():
        client = AsyncScoringClient(server.target)
        await client.close()
        begin = time.monotonic()
        with pytest.raises(ScoringError) as info:
            await client.wait_until_serving(timeout=30, interval=0.05)
        return info.value, time.monotonic() - begin

    error, elapsed = asyncio.run(main())
    assert_closed(error)
    assert elapsed < 5  # at once, not after the 30 s timeout
    assert sent(server) == 0


@pytest.mark.parametrize("phase", ["sleeping", "probing"])
def test_close_wakes_a_sync_wait_until_serving(server, phase):
    """Closed between two probes (a NOT_SERVING answer, 30 s before the next) or
    during a probe the server holds: the wait ends at once with the closed error."""
    if phase == "sleeping":
        server.set_serving(False)
    else:
        server.scorer.gate.clear()
    client = ScoringClient(server.target)
    errors: list[BaseException] = []

    def run():
        try:
            client.wait_until_serving(timeout=60, interval=30)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        wait_for(lambda: server.health.checks == 1)
        time.sleep(0.1)
        begin = time.monotonic()
        client.close()
        thread.join(10)
        assert not thread.is_alive() and time.monotonic() - begin < 2
    finally:
        server.scorer.gate.set()
        thread.join(10)
    (error,) = errors
    assert_closed(error)
    time.sleep(0.1)
    assert server.health.checks == 1


@pytest.mark.parametrize("phase", ["sleeping", "probing"])
def test_close_wakes_an_async_wait_until_serving(server, phase):
    if phase == "sleeping":
        server.set_serving(False)
    else:
        server.scorer.gate.clear()

    async def main():
        client = AsyncScoringClient(server.target)
        task = asyncio.ensure_future(client.wait_until_serving(timeout=60, interval=30))
        await async_wait_for(lambda: server.health.checks == 1)
        await asyncio.sleep(0.1)
        begin = time.monotonic()
        await client.close()
        with pytest.raises(ScoringError) as info:
            await asyncio.wait_for(task, 5)
        return info.value, time.monotonic() - begin

    try:
        error, elapsed = asyncio.run(main())
    finally:
        server.scorer.gate.set()
    assert_closed(error)
    assert elapsed < 2
    time.sleep(0.1)
    assert server.health.checks == 1


# ------------------------------------------------------------------ async calls in flight

CALLS = {
    "score": (lambda c: c.score(SEQS), "Score"),
    "model_info": (lambda c: c.model_info(), "GetModelInfo"),
    "load_weights": (lambda c: c.load_weights("hf:/ckpt", "w1"), "LoadWeights"),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_close_turns_an_async_call_in_flight_into_the_closed_error(held, name):
    """close() cancels the calls in flight: grpc.aio raises CancelledError in the
    awaiting task, which the client reports as the documented ScoringError."""
    call, method = CALLS[name]
    scorer = held.scorer

    async def main():
        # wait_for_server_s: a closed-client CANCELLED is not re-sent either
        client = AsyncScoringClient(
            held.target, max_request_tokens=None, wait_for_server_s=10, timeout=30
        )
        task = asyncio.ensure_future(call(client))
        await async_wait_for(lambda: scorer.calls[method] == 1)
        await client.close()
        with pytest.raises(ScoringError) as info:
            await asyncio.wait_for(task, 5)
        assert_closed(info.value)
        assert not task.cancelled()
        scorer.gate.set()
        with pytest.raises(ScoringError) as info:  # later calls send nothing
            await call(client)
        assert_closed(info.value)
        await asyncio.sleep(0.1)

    asyncio.run(main())
    assert sum(scorer.calls.values()) == 1 and scorer.calls[method] == 1


def test_close_turns_an_async_health_probe_in_flight_into_the_closed_error(held):
    async def main():
        client = AsyncScoringClient(held.target)
        task = asyncio.ensure_future(client.health())
        await async_wait_for(lambda: held.health.checks == 1)
        await client.close()
        with pytest.raises(ScoringError) as info:
            await asyncio.wait_for(task, 5)
        return info.value

    assert_closed(asyncio.run(main()))
    assert held.health.checks == 1


def test_close_fails_every_part_of_an_async_split_batch_in_flight():
    limit = 64 * 1024
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(500, 2000, 60)]
    with FakeServer(FakeScorer(), max_message_bytes=limit) as srv:
        srv.scorer.gate.clear()

        async def main():
            client = AsyncScoringClient(
                srv.target, max_message_bytes=limit, max_request_tokens=None, max_concurrency=3
            )
            task = asyncio.ensure_future(client.score(seqs))
            await async_wait_for(lambda: srv.scorer.calls["Score"] == 3)
            await client.close()
            with pytest.raises(ScoringError) as info:
                await asyncio.wait_for(task, 5)
            srv.scorer.gate.set()
            await asyncio.sleep(0.2)
            return info.value

        try:
            error = asyncio.run(main())
        finally:
            srv.scorer.gate.set()
        assert_closed(error)
        assert srv.scorer.calls["Score"] == 3  # no part started after close()


@pytest.mark.parametrize("also_close", [False, True])
def test_a_genuine_task_cancellation_still_raises_cancelled_error(held, also_close):
    """task.cancel() is the caller's own cancellation: CancelledError, even when the
    client is closed while the cancelled task unwinds."""

    async def main():
        client = AsyncScoringClient(held.target, max_request_tokens=None, timeout=30)
        task = asyncio.ensure_future(client.score(SEQS))
        await async_wait_for(lambda: held.scorer.calls["Score"] == 1)
        task.cancel()
        if also_close:
            await client.close()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()
        if not also_close:  # the client stays usable
            held.scorer.gate.set()
            assert len(await client.score(SEQS)) == 2
        await client.close()

    asyncio.run(main())

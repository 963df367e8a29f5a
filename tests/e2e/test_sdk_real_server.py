"""Issue 6: the SDK's automatic splitting and its retries against a real ``megascore serve``.

``tests/client`` checks both against a fake in-process gRPC server; here the server is
the real subprocess (built-in ``tiny`` model, CPU), started on a fixed port below the
ephemeral range with a 64 KiB gRPC message limit (``--max-message-bytes``):

* a batch whose single request (and response) would exceed that limit is split by
  ``ScoringClient.score`` / ``AsyncScoringClient.score`` into several requests that
  each fit it (the server itself rejects a larger one), reassembled in order, bit for
  bit equal to scoring each sequence alone on the same server; a default client
  (256 MiB) learns the server's limit from ``ModelInfo.max_message_bytes``;
* a job of score calls (sync and asyncio clients with ``wait_for_server_s``) survives
  a SIGTERM of its server and a new server started on the same port (connection
  refused, then UNAVAILABLE "model loading" for the new server's start-up), with
  results equal to an uninterrupted run; while the port is closed, calls without the
  option (gRPC's retries only: none, a short policy, the default one) fail with
  UNAVAILABLE, and a short ``wait_for_server_s`` gives up with UNAVAILABLE after it.

The server is shared by the module (the restart test replaces it with the new one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from megascore.v1 import scoring_pb2_grpc as pb_grpc
from megascore_client import AsyncScoringClient, RetryPolicy, ScoringClient, ScoringError
from megascore_client.inputs import make_batch
from megascore_client.splitting import ScoreOptions, build_parts
from megascore_server.ports import pick_port
from testkit.reference import LOSSES, VOCAB, assert_results_equal, assert_top_k_close
from tests.e2e.serve import ServeProcess, own_servers

LIMIT = 64 * 1024  # the smallest max_message_bytes the client accepts
SERVE_ARGS = ("--model", "tiny", "--max-message-bytes", str(LIMIT), "--grace-s", "2")
RPC_TIMEOUT_S = 120.0


@dataclasses.dataclass
class FixedPortServer:
    """The module's server on a fixed port, and how to start another one on that port."""

    port: int
    start: object  # own_servers' start(*args, **kw)
    server: ServeProcess | None = None
    start_s: float = 0.0  # how long the first server took to be SERVING

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def launch(self) -> ServeProcess:
        """Starts a server on the port (does not wait for it) and makes it the current one."""
        self.server = self.start(*SERVE_ARGS, port=self.port, metrics=True)
        return self.server


@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    servers = own_servers(tmp_path_factory.mktemp("sdk-real-server"))
    holder = FixedPortServer(port=pick_port(), start=next(servers))
    try:
        begin = time.monotonic()
        holder.launch().wait_serving()
        holder.start_s = time.monotonic() - begin
        yield holder
    finally:
        servers.close()  # kills every server of the module (own_servers' cleanup)


@pytest.fixture
def server(fixed) -> ServeProcess:
    assert fixed.server.running(), f"server exited:\n{fixed.server.output()}"
    return fixed.server


def scrape(server: ServeProcess) -> dict[tuple[str, tuple], float]:
    samples = {}
    for family in text_string_to_metric_families(server.metrics_text()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def score_ok(samples: dict) -> float:
    return samples.get(
        ("megascore_requests_total", (("code", "OK"), ("front", "grpc"), ("rpc", "Score"))), 0.0
    )


# ---------------------------------------------------------------------------- splitting


@pytest.fixture(scope="module")
def big_batch():
    """~26k tokens with a loss mask: one request would be ~130 KB, over the 64 KiB limit."""
    rng = np.random.default_rng(6)
    seqs = [rng.integers(0, VOCAB, int(n)) for n in rng.integers(400, 1000, size=36)]
    masks = [(rng.random(len(s)) < 0.7).astype(np.uint8) for s in seqs]
    return seqs, masks


@pytest.fixture(scope="module")
def alone(fixed, big_batch):
    """Each sequence of ``big_batch`` scored alone (one request each) on the same server."""
    seqs, masks = big_batch
    with ScoringClient(fixed.target, timeout=RPC_TIMEOUT_S, retries=None) as client:
        return [
            client.score([s], loss_mask=[m], top_k=2, losses=LOSSES)
            for s, m in zip(seqs, masks, strict=True)
        ]


def unsplit_request(seqs, masks, top_k: int):
    batch = make_batch(seqs, loss_mask=masks)
    options = ScoreOptions(top_k=top_k, losses=LOSSES)
    (part,) = build_parts(batch, options, "whole", max_message_bytes=1 << 30)
    return part.request


def unsplit_request_bytes(seqs, masks, top_k: int) -> int:
    return unsplit_request(seqs, masks, top_k).ByteSize()


def expected_parts(seqs, masks, top_k: int, limit: int | None) -> int:
    batch = make_batch(seqs, loss_mask=masks)
    options = ScoreOptions(top_k=top_k, losses=LOSSES)
    return len(build_parts(batch, options, "x", max_message_bytes=LIMIT, max_request_tokens=limit))


class SpyScore:
    """Wraps a stub's ``Score`` callable: records the id and size of every request sent."""

    def __init__(self, inner):
        self.inner = inner
        self.sent: list[tuple[str, int]] = []

    def _record(self, request):
        self.sent.append((request.request_id, request.ByteSize()))

    def __call__(self, request, **kwargs):
        self._record(request)
        return self.inner(request, **kwargs)

    def future(self, request, **kwargs):
        self._record(request)
        return self.inner.future(request, **kwargs)


def assert_split_result(result, spy, seqs, alone, *, top_k: int, request_id: str, parts: int):
    assert parts > 1
    assert result.timings.num_requests == len(spy.sent) == parts
    assert sorted(rid for rid, _ in spy.sent) == sorted(f"{request_id}/{i}" for i in range(parts))
    assert all(size < LIMIT for _, size in spy.sent), spy.sent
    assert result.request_id == request_id and len(result) == len(seqs)
    assert result.lengths.tolist() == [len(s) for s in seqs]
    for i, one in enumerate(alone):  # in input order, bit for bit
        np.testing.assert_array_equal(result.logprobs[i], one.logprobs[0])
        for name in LOSSES:
            np.testing.assert_array_equal(result.loss[name][i], one.loss[name][0])
        assert result.num_tokens[i] == one.num_tokens[0]
        if top_k:
            assert_top_k_close(
                result.top_k_ids[i],
                result.top_k_logprobs[i],
                one.top_k_ids[0],
                one.top_k_logprobs[0],
                atol=0.0,
            )


@pytest.mark.timeout(600)
def test_sync_client_splits_a_batch_over_the_real_message_limit(server, big_batch, alone):
    seqs, masks = big_batch
    whole = unsplit_request(seqs, masks, top_k=0)
    assert whole.ByteSize() > LIMIT
    # The limit is real: the same batch in one request (a raw stub) is refused.
    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.ScorerStub(channel).Score(whole, timeout=RPC_TIMEOUT_S)
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
    with ScoringClient(
        server.target, timeout=RPC_TIMEOUT_S, retries=None, max_message_bytes=LIMIT
    ) as client:
        limit = client.request_token_limit()  # GetModelInfo before the first scrape
        spy = client.transport.stub.Score = SpyScore(client.transport.stub.Score)
        before = score_ok(scrape(server))
        result = client.score(seqs, loss_mask=masks, losses=LOSSES, request_id="big-sync")
        served = score_ok(scrape(server)) - before
    parts = expected_parts(seqs, masks, 0, limit)
    assert served == parts  # the server answered one request per part
    assert_split_result(result, spy, seqs, alone, top_k=0, request_id="big-sync", parts=parts)


@pytest.mark.timeout(600)
def test_async_client_splits_a_batch_over_the_real_message_limit(server, big_batch, alone):
    seqs, masks = big_batch
    assert unsplit_request_bytes(seqs, masks, top_k=2) > LIMIT

    async def run():
        async with AsyncScoringClient(
            server.target,
            timeout=RPC_TIMEOUT_S,
            retries=None,
            max_message_bytes=LIMIT,
            max_concurrency=3,
        ) as client:
            limit = await client.request_token_limit()
            spy = client.transport.stub.Score = SpyScore(client.transport.stub.Score)
            before = score_ok(scrape(server))
            result = await client.score(
                seqs, loss_mask=masks, top_k=2, losses=LOSSES, request_id="big-async"
            )
            return result, spy, limit, score_ok(scrape(server)) - before

    result, spy, limit, served = asyncio.run(run())
    # top_k=2 makes the responses (28 bytes per token) the binding limit: more parts.
    parts = expected_parts(seqs, masks, 2, limit)
    assert parts > expected_parts(seqs, masks, 0, limit)
    assert served == parts
    assert_split_result(result, spy, seqs, alone, top_k=2, request_id="big-async", parts=parts)


@pytest.mark.timeout(600)
def test_default_client_splits_under_the_limit_the_server_advertises(server, big_batch, alone):
    """No ``max_message_bytes`` given (256 MiB): the client splits under the server's
    64 KiB, learnt from ModelInfo with its token limit, instead of RESOURCE_EXHAUSTED."""
    seqs, masks = big_batch
    with ScoringClient(server.target, timeout=RPC_TIMEOUT_S, retries=None) as client:
        assert client.model_info().max_message_bytes == LIMIT
        limit = client.request_token_limit()  # GetModelInfo before the first scrape
        assert client.message_limit == LIMIT < client.settings.max_message_bytes
        spy = client.transport.stub.Score = SpyScore(client.transport.stub.Score)
        before = score_ok(scrape(server))
        result = client.score(
            seqs, loss_mask=masks, top_k=2, losses=LOSSES, request_id="big-default"
        )
        served = score_ok(scrape(server)) - before
    parts = expected_parts(seqs, masks, 2, limit)
    assert served == parts
    assert_split_result(result, spy, seqs, alone, top_k=2, request_id="big-default", parts=parts)


# ---------------------------------------------------------------------------- retries

PAUSE_AT = 3  # each job scores this many batches, waits while the server restarts, goes on


@dataclasses.dataclass
class Job:
    """A loop of score calls that pauses once (after ``PAUSE_AT`` calls) for the restart."""

    name: str
    paused: threading.Event = dataclasses.field(default_factory=threading.Event)
    issued: threading.Event = dataclasses.field(default_factory=threading.Event)
    results: list = dataclasses.field(default_factory=list)
    spans: list = dataclasses.field(default_factory=list)  # (start, end) of each call
    error: BaseException | None = None


def job_batches() -> list[list[list[int]]]:
    rng = np.random.default_rng(11)
    return [
        [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(1, 120, size=4)]
        for _ in range(6)
    ]


def run_sync_job(job: Job, target, wait_s, timeout, batches, released: threading.Event):
    try:
        with ScoringClient(target, wait_for_server_s=wait_s, timeout=timeout) as client:
            for i, batch in enumerate(batches):
                if i == PAUSE_AT:
                    job.paused.set()
                    released.wait()
                    job.issued.set()
                start = time.monotonic()
                job.results.append(client.score(batch, top_k=2, losses=LOSSES))
                job.spans.append((start, time.monotonic()))
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        job.error = exc
    finally:
        job.paused.set()
        job.issued.set()


def run_async_job(job: Job, target, wait_s, timeout, batches, released: threading.Event):
    async def run():
        async with AsyncScoringClient(target, wait_for_server_s=wait_s, timeout=timeout) as client:
            for i, batch in enumerate(batches):
                if i == PAUSE_AT:
                    job.paused.set()
                    await asyncio.to_thread(released.wait)
                    job.issued.set()
                start = time.monotonic()
                job.results.append(await client.score(batch, top_k=2, losses=LOSSES))
                job.spans.append((start, time.monotonic()))

    try:
        asyncio.run(run())
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        job.error = exc
    finally:
        job.paused.set()
        job.issued.set()


def restart_wait(start_s: float) -> tuple[float, float]:
    """``wait_for_server_s`` covering a restart, and a request timeout above it.

    The wait is max(60 s, 4x the start-up time of the first server: the new one may
    start slower on a busy host); the timeout adds the longest scoring time to it (the
    re-sends happen inside each request's deadline).
    """
    wait_s = max(60.0, 4 * start_s)
    return wait_s, wait_s + RPC_TIMEOUT_S


@pytest.mark.timeout(900)
def test_job_survives_a_server_restart_on_the_same_port(fixed, server):
    batches = job_batches()
    with ScoringClient(server.target, timeout=RPC_TIMEOUT_S, retries=None) as client:
        reference = [client.score(b, top_k=2, losses=LOSSES) for b in batches]
    wait_s, timeout = restart_wait(fixed.start_s)
    released = threading.Event()
    jobs = [Job("sync"), Job("async")]
    threads = [
        threading.Thread(
            target=runner, args=(job, fixed.target, wait_s, timeout, batches, released)
        )
        for runner, job in zip((run_sync_job, run_async_job), jobs, strict=True)
    ]
    for thread in threads:
        thread.start()
    try:
        for job in jobs:
            assert job.paused.wait(RPC_TIMEOUT_S) and job.error is None, job.error
        assert server.terminate(timeout=60) == 0, server.output()  # SIGTERM to its pid
        assert not server.leftovers(), "old server left processes"

        # The port is closed. Without wait_for_server_s, gRPC's retries (none, a short
        # policy, the default 5 attempts: 2.4-3.6 s of backoff) end in UNAVAILABLE;
        # a wait shorter than the outage ends in UNAVAILABLE saying how long it waited.
        short = RetryPolicy(max_attempts=3, initial_backoff_s=0.2, max_backoff_s=0.4)
        for retries, wait, least_s in (
            (None, 0.0, 0.0),
            (short, 0.0, 0.8 * (0.2 + 0.4)),
            (True, 0.0, 0.8 * (0.2 + 0.4 + 0.8 + 1.6)),
            (None, 1.5, 1.5),
        ):
            with ScoringClient(
                fixed.target,
                retries=retries,
                wait_for_server_s=wait,
                timeout=30,
                max_request_tokens=None,
            ) as down:
                begin = time.monotonic()
                with pytest.raises(ScoringError) as info:
                    down.score(batches[0])
                elapsed = time.monotonic() - begin
            assert info.value.code is grpc.StatusCode.UNAVAILABLE, info.value
            assert info.value.retryable and least_s <= elapsed < 10, (retries, wait, elapsed)
            assert ("[waited " in info.value.details) == (wait > 0), info.value.details

        released.set()  # both jobs issue their next call while nothing listens
        for job in jobs:
            assert job.issued.wait(30)
        restarted_at = time.monotonic()
        new = fixed.launch()
        new.wait_serving()
        serving_at = time.monotonic()
        for thread in threads:
            thread.join(timeout + 60)
    finally:
        released.set()
        for thread in threads:
            thread.join(timeout + 60)
    for job in jobs:
        assert job.error is None, f"{job.name} job failed: {job.error!r}"
        assert len(job.results) == len(batches)
        for got, want in zip(job.results, reference, strict=True):
            assert_results_equal(got, want)  # bit for bit
        start, end = job.spans[PAUSE_AT]
        # the call went out before the new server existed and was answered by it
        assert start < restarted_at < end, (start, restarted_at, end)
    assert new.pid != server.pid
    assert score_ok(scrape(new)) == len(jobs) * (len(batches) - PAUSE_AT)
    print(
        f"restart: first start-up {fixed.start_s:.1f} s, new server SERVING after "
        f"{serving_at - restarted_at:.1f} s, wait_for_server_s {wait_s:.0f} s; "
        f"straddling calls took "
        + ", ".join(f"{j.name} {j.spans[PAUSE_AT][1] - j.spans[PAUSE_AT][0]:.1f} s" for j in jobs)
    )

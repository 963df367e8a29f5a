"""Runs a real ``grpc.aio`` server (port 0, 127.0.0.1) on a background event loop.

Tests talk to it with plain synchronous gRPC stubs (``ScorerStub``), so
concurrency in tests is ordinary threads; the server side is the production
asyncio code path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import threading
import time

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from megascore.api.types import ScoreBatch
from megascore.api.wire import decode_array, encode_array
from megascore.v1 import scoring_pb2 as pb
from megascore.v1 import scoring_pb2_grpc as pb_grpc
from megascore_server.app import build_server
from megascore_server.config import GrpcServerConfig


class ServerThread:
    """A built server on its own event-loop thread; ``stop()`` tears everything down.

    With ``engine=None`` the server starts without an engine (model loading);
    :meth:`load` then builds one on the engine thread and attaches it.
    """

    def __init__(
        self,
        engine,
        config: GrpcServerConfig | None = None,
        *,
        start: bool = True,
        pad_multiple: int = 1,
        **kw,
    ):
        self.engine = engine
        self.pad_multiple = pad_multiple
        self.config = config or GrpcServerConfig(port=0, **kw)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._channels: list[grpc.Channel] = []
        try:
            self.server, self.port, self.handles = self.call(self._build())
            if start:
                self.call(self.handles.start())
        except BaseException:
            self._stop_loop()
            raise

    async def _build(self):
        return build_server(self.engine, self.config, pad_multiple=self.pad_multiple)

    def load(self, factory) -> concurrent.futures.Future:
        """Starts ``load_engine(factory)`` then ``attach_engine``; the future yields the engine."""

        async def load_and_attach():
            engine = await self.handles.load_engine(factory)
            self.engine = engine
            await self.handles.attach_engine(engine, pad_multiple=self.pad_multiple)
            return engine

        return asyncio.run_coroutine_threadsafe(load_and_attach(), self.loop)

    def call(self, coro, timeout: float = 30):
        """Runs a coroutine on the server loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def channel(self, **options) -> grpc.Channel:
        opts = [(f"grpc.{k}", v) for k, v in options.items()]
        ch = grpc.insecure_channel(self.address, options=opts)
        self._channels.append(ch)
        return ch

    def stub(self, **options) -> pb_grpc.ScorerStub:
        return pb_grpc.ScorerStub(self.channel(**options))

    def health(self, service: str = "") -> int:
        stub = health_pb2_grpc.HealthStub(self.channel())
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def stop(self, grace: float = 0.0) -> None:
        for ch in self._channels:
            ch.close()
        try:
            self.call(self.handles.stop(grace), timeout=60)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclasses.dataclass
class Req:
    """A request in test form: sequences as lists of ids, plus options."""

    seqs: list[list[int]]
    request_id: str = ""
    top_k: int = 0
    temperature: float | None = None
    losses: tuple[str, ...] = ()
    logprobs: bool = True
    mask: list[list[int]] | None = None
    moe: bool = False
    mtp: bool = False

    def proto(self, id_dtype=np.int64) -> pb.ScoreRequest:
        options = pb.ScoreOptions(
            return_logprobs=self.logprobs,
            top_k=self.top_k,
            losses=list(self.losses),
            return_moe_metrics=self.moe,
            return_mtp_metrics=self.mtp,
        )
        if self.temperature is not None:
            options.temperature = self.temperature
        request = pb.ScoreRequest(
            request_id=self.request_id,
            token_ids=encode_array(
                np.concatenate([np.asarray(s) for s in self.seqs]).astype(id_dtype)
            ),
            lengths=encode_array(np.array([len(s) for s in self.seqs], dtype=np.int64)),
            options=options,
        )
        if self.mask is not None:
            request.loss_mask.CopyFrom(encode_array(np.concatenate(self.mask).astype(np.uint8)))
        return request

    def batch(self) -> ScoreBatch:
        """The request alone as an engine batch (for the expected values)."""
        lengths = np.array([len(s) for s in self.seqs], dtype=np.int64)
        return ScoreBatch(
            token_ids=np.concatenate([np.asarray(s, dtype=np.int64) for s in self.seqs]),
            lengths=lengths,
            loss_mask=None if self.mask is None else np.concatenate(self.mask).astype(np.uint8),
            temperature=np.full(lengths.size, self.temperature or 1.0, dtype=np.float32),
            top_k=self.top_k,
            losses=self.losses,
            return_logprobs=self.logprobs,
            return_moe_metrics=self.moe,
            return_mtp_metrics=self.mtp,
        )


def check_response(response: pb.ScoreResponse, req: Req, weights_version: str = "v0") -> None:
    """Asserts ``response`` carries exactly ``req``'s sequences, in order, with its options."""
    from tests.service.fake_engine import compute

    expected = compute(req.batch(), weights_version)
    assert response.request_id == req.request_id
    assert response.weights_version == weights_version
    np.testing.assert_array_equal(decode_array(response.lengths, "lengths"), req.batch().lengths)
    if req.logprobs:
        np.testing.assert_array_equal(
            decode_array(response.token_logprobs, "token_logprobs"), expected.logprobs
        )
    else:
        assert not response.HasField("token_logprobs")
    assert response.top_k == req.top_k
    if req.top_k:
        num_tokens = expected.logprobs.size
        ids = decode_array(response.top_k_ids, "top_k_ids").reshape(num_tokens, req.top_k)
        lps = decode_array(response.top_k_logprobs, "top_k_logprobs").reshape(num_tokens, req.top_k)
        np.testing.assert_array_equal(ids, expected.top_k_ids)
        np.testing.assert_array_equal(lps, expected.top_k_logprobs)
    else:
        assert not response.HasField("top_k_ids")
    assert set(response.sequence_losses) == set(req.losses)
    for name in req.losses:
        got = decode_array(response.sequence_losses[name], name)
        np.testing.assert_allclose(got, expected.losses[name], rtol=1e-12)
    np.testing.assert_array_equal(
        decode_array(response.num_loss_tokens, "num_loss_tokens"), expected.num_loss_tokens
    )
    assert dict(response.moe_metrics).keys() == (expected.moe_metrics.keys() if req.moe else set())
    assert dict(response.mtp_metrics).keys() == (expected.mtp_metrics.keys() if req.mtp else set())
    assert response.timings.num_steps >= 1
    assert response.timings.total_ms >= response.timings.queue_ms >= 0


def random_req(rng: np.random.Generator, request_id: str, max_seqs: int = 6, max_len: int = 60):
    n = int(rng.integers(1, max_seqs + 1))
    seqs = [rng.integers(0, 1000, int(rng.integers(1, max_len + 1))).tolist() for _ in range(n)]
    return Req(
        seqs=seqs,
        request_id=request_id,
        top_k=int(rng.integers(0, 5)),
        temperature=float(rng.choice([0.5, 1.0, 2.0])),
        losses=[(), ("nll",), ("mean_nll", "nll")][int(rng.integers(0, 3))],
        logprobs=bool(rng.integers(0, 2)),
    )


@contextlib.contextmanager
def engine_held(server: ServerThread):
    """Holds the engine inside a step: send a blocker, keep the gate closed, then open it.

    Yields the blocker's future (it completes once the gate opens); everything
    sent meanwhile queues up behind it.
    """
    engine = server.engine
    version = engine.version
    gate = threading.Event()
    engine.gate = gate
    engine.started.clear()
    blocker = Req([[7, 7, 7]], request_id="blocker")
    future = server.stub().Score.future(blocker.proto(), timeout=30)
    try:
        assert engine.started.wait(10), "engine never started the blocker step"
        yield future
    finally:
        engine.gate = None
        gate.set()
    check_response(future.result(timeout=30), blocker, version)


def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Polls ``predicate`` until true (fails the test after ``timeout``)."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def serving(engine, **options):
    """Body of a ``server`` fixture (``yield from``): ``engine`` behind a real gRPC
    server (``options``: ServerThread's), stopped after its tests."""
    srv = ServerThread(engine, **options)
    try:
        yield srv
    finally:
        srv.stop()

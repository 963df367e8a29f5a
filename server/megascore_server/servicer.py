"""Thin async servicer of ``megascore.v1.Scorer``: validate, convert, await, convert back.

No torch here: the engine sits behind the :class:`DynamicBatcher`. Errors are
mapped to status codes by :func:`megascore_server.status.status_for` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import grpc

from megascore.errors import (
    CheckpointError,
    InvalidRequestError,
    MegascoreError,
    UnavailableError,
)
from megascore.types import ModelInfo
from megascore.v1 import scoring_pb2 as pb
from megascore.v1 import scoring_pb2_grpc as pb_grpc
from megascore_server.batcher import DynamicBatcher
from megascore_server.convert import build_response, model_info_to_proto
from megascore_server.health import ScorerHealth
from megascore_server.metrics import ServerMetrics
from megascore_server.status import status_for
from megascore_server.validation import RequestLimits, validate_request

logger = logging.getLogger(__name__)


def _new_request_id() -> str:
    return "srv-" + uuid.uuid4().hex[:16]


LOADING_MESSAGE = (
    "server is starting: model loading on every rank (health NOT_SERVING until it is "
    "loaded); retry later"
)
SHUTTING_DOWN_MESSAGE = "server shutting down: retry on another replica"
_DRAIN = object()  # wakes an open ScoreStream when the drain begins


class ScorerServicer(pb_grpc.ScorerServicer):
    """``megascore.v1.Scorer`` on top of a :class:`DynamicBatcher`.

    Every RPC answers UNAVAILABLE (:data:`LOADING_MESSAGE`) until :meth:`attach`
    gives it the engine's batcher, so the server can start while the model loads.
    After :meth:`start_draining`, every new call (and new message of an open stream)
    answers UNAVAILABLE (:data:`SHUTTING_DOWN_MESSAGE`) while the calls already in
    progress finish (:meth:`wait_idle`); :meth:`park_new_calls` /
    :meth:`release_parked` hold new calls around the final ``server.stop()``
    (:mod:`megascore_server.lifecycle`).

    Args:
        health: health servicer; requests are refused while it is not SERVING.
        max_tokens_per_batch: step budget, reported in ``ModelInfo``.
        max_message_bytes: the gRPC server's message size limit (both directions),
            reported in ``ModelInfo`` so that clients split batches under it.
        max_stream_inflight: ScoreStream messages submitted ahead of their responses.
        metrics: optional Prometheus metrics.
    """

    def __init__(
        self,
        health: ScorerHealth,
        *,
        max_tokens_per_batch: int,
        max_message_bytes: int,
        max_stream_inflight: int = 32,
        metrics: ServerMetrics | None = None,
    ):
        self._health = health
        self._max_tokens_per_batch = max_tokens_per_batch
        self._max_message_bytes = max_message_bytes
        self._max_stream_inflight = max_stream_inflight
        self._metrics = metrics
        self._batcher: DynamicBatcher | None = None
        self._limits: RequestLimits | None = None
        self._info: ModelInfo | None = None
        self._draining = False
        self._parked: asyncio.Event | None = None  # set: parked calls get UNAVAILABLE
        self._active = 0  # Score / ScoreStream / LoadWeights handlers running
        self._idle = asyncio.Event()
        self._idle.set()
        self._open_streams: set[asyncio.Queue] = set()

    def attach(self, batcher: DynamicBatcher, limits: RequestLimits, info: ModelInfo) -> None:
        """Serves the engine behind ``batcher`` (its limits and model description)."""
        self._batcher, self._limits, self._info = batcher, limits, info

    def _ready(self) -> DynamicBatcher:
        if self._draining:
            raise UnavailableError(SHUTTING_DOWN_MESSAGE)
        if self._batcher is None:
            raise UnavailableError(LOADING_MESSAGE)
        return self._batcher

    def start_draining(self) -> None:
        """From now on new calls (and new stream messages) fail fast with UNAVAILABLE;
        an open stream ends (UNAVAILABLE) once it has answered what it already got."""
        self._draining = True
        for queue in self._open_streams:
            queue.put_nowait(_DRAIN)

    def park_new_calls(self) -> None:
        """New calls wait (unanswered) until :meth:`release_parked`, then fail UNAVAILABLE.

        For the instant grpc core shuts down: a client whose call is parked sends
        nothing new, and a call that reaches grpc core after its shutdown began is
        cancelled (CANCELLED) before any handler sees it.
        """
        self._draining = True
        if self._parked is None:
            self._parked = asyncio.Event()

    def release_parked(self) -> None:
        """Parked (and later) calls fail with UNAVAILABLE now."""
        if self._parked is not None:
            self._parked.set()

    async def _refuse_when_draining(self) -> None:
        if not self._draining:
            return
        if self._parked is not None:
            await self._parked.wait()
        raise UnavailableError(SHUTTING_DOWN_MESSAGE)

    @property
    def active_calls(self) -> int:
        """Score / ScoreStream / LoadWeights handlers still running."""
        return self._active

    async def wait_idle(self, timeout: float) -> bool:
        """Waits up to ``timeout`` s for the running calls to end; True when none is left."""
        if self._active == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), max(timeout, 0.0))
        except TimeoutError:
            return False
        return True

    @contextlib.contextmanager
    def _tracked(self):
        self._active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    def _observe(self, rpc: str, code: grpc.StatusCode, start: float) -> None:
        if self._metrics is not None:
            self._metrics.observe_request(rpc, code.name, time.monotonic() - start)

    async def _score_one(
        self, request: pb.ScoreRequest, request_id: str, arrival: float, remaining: float | None
    ) -> pb.ScoreResponse:
        batcher = self._ready()
        if not self._health.serving:
            raise UnavailableError("server is not serving (starting up or draining)")
        batch = validate_request(request, self._limits)
        deadline = None if remaining is None else arrival + remaining
        result = await batcher.submit(request_id, batch, arrival=arrival, deadline=deadline)
        timings = pb.Timings(
            queue_ms=result.queue_ms, compute_ms=result.compute_ms, num_steps=result.num_steps
        )
        response = build_response(request.request_id, batch, result.output, timings)
        response.timings.total_ms = (time.monotonic() - arrival) * 1000.0
        logger.info(
            "request_id=%s seqs=%d tokens=%d top_k=%d steps=%d queue_ms=%.1f compute_ms=%.1f "
            "total_ms=%.1f weights=%s",
            request_id,
            batch.num_sequences,
            batch.num_tokens,
            batch.top_k,
            result.num_steps,
            result.queue_ms,
            result.compute_ms,
            response.timings.total_ms,
            response.weights_version,
        )
        return response

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext):
        """Scores one request (merged with concurrent ones by the batcher)."""
        arrival = time.monotonic()
        request_id = request.request_id or _new_request_id()
        with self._tracked():
            try:
                await self._refuse_when_draining()
                remaining = context.time_remaining()
                response = await self._score_one(request, request_id, arrival, remaining)
            except asyncio.CancelledError:
                logger.info("request_id=%s cancelled by the client", request_id)
                self._observe("Score", grpc.StatusCode.CANCELLED, arrival)
                raise
            except Exception as exc:
                code, message = status_for(exc, request_id)
                logger.info("request_id=%s failed: %s %s", request_id, code.name, message)
                self._observe("Score", code, arrival)
                await context.abort(code, message)
        self._observe("Score", grpc.StatusCode.OK, arrival)
        return response

    async def ScoreStream(self, request_iterator, context: grpc.aio.ServicerContext):
        """One response per request message, in order; the first error ends the stream."""
        slots = asyncio.Semaphore(self._max_stream_inflight)
        queue: asyncio.Queue = asyncio.Queue()
        reader_error: list[BaseException] = []

        async def read() -> None:
            index = 0
            try:
                async for request in request_iterator:
                    await slots.acquire()
                    arrival = time.monotonic()
                    request_id = request.request_id or _new_request_id()
                    label = f"{request_id} (stream message {index})"
                    task = asyncio.ensure_future(
                        self._score_one(request, request_id, arrival, context.time_remaining())
                    )
                    queue.put_nowait((label, arrival, task))
                    index += 1
            except Exception as exc:
                reader_error.append(exc)
            finally:
                queue.put_nowait(None)

        with self._tracked():
            try:
                await self._refuse_when_draining()
            except UnavailableError as exc:
                code, message = status_for(exc)
                self._observe("ScoreStream", code, time.monotonic())
                await context.abort(code, message)
            self._open_streams.add(queue)
            reader = asyncio.ensure_future(read())
            try:
                responses = self._stream_responses(queue, reader_error, slots, context)
                async with contextlib.aclosing(responses):
                    async for response in responses:
                        yield response
            finally:
                self._open_streams.discard(queue)
                reader.cancel()
                while not queue.empty():
                    item = queue.get_nowait()
                    if item is None or item is _DRAIN:
                        continue
                    task = item[2]
                    if not task.done():
                        task.cancel()  # the batcher drops it
                    elif not task.cancelled():
                        task.exception()  # retrieved: a later failure is not logged as lost

    async def _stream_responses(self, queue: asyncio.Queue, reader_error, slots, context):
        while True:
            if self._draining and queue.empty():
                # Idle (every answer sent): end the stream now rather than hold the drain.
                code, message = status_for(UnavailableError(SHUTTING_DOWN_MESSAGE))
                self._observe("ScoreStream", code, time.monotonic())
                await context.abort(code, message)
            item = await queue.get()
            if item is None:
                break
            if item is _DRAIN:  # wakes an idle stream for the check above
                continue
            label, arrival, task = item
            try:
                response = await task
            except Exception as exc:
                code, message = status_for(exc, label)
                logger.info("stream request_id=%s failed: %s %s", label, code.name, message)
                self._observe("ScoreStream", code, arrival)
                await context.abort(code, message)
            finally:
                slots.release()
            self._observe("ScoreStream", grpc.StatusCode.OK, arrival)
            yield response
        if reader_error:
            raise reader_error[0]

    async def _load_weights(self, request: pb.LoadWeightsRequest) -> tuple[str, str, ModelInfo]:
        await self._refuse_when_draining()
        batcher = self._ready()
        if not request.model:
            raise InvalidRequestError(
                "model: required ('hf:DIR', 'megatron:DIR' or 'builtin:NAME@SEED')"
            )
        logger.info("loading weights %s (version %r)", request.model, request.weights_version)
        previous = batcher.weights_version
        try:
            return await batcher.load_weights(request.model, request.weights_version)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc.reason}; still serving weights {previous!r}") from exc
        except MegascoreError:
            raise
        except Exception as exc:
            logger.error("LoadWeights %s: unexpected error", request.model, exc_info=exc)
            raise CheckpointError(
                f"loading {request.model} failed ({type(exc).__name__}: {exc}); "
                f"still serving weights {previous!r}"
            ) from exc

    async def GetModelInfo(self, request, context: grpc.aio.ServicerContext):
        """The model, its current weights version and the server's limits."""
        start = time.monotonic()
        try:
            await self._refuse_when_draining()
            batcher = self._ready()
        except UnavailableError as exc:
            code, message = status_for(exc)
            self._observe("GetModelInfo", code, start)
            await context.abort(code, message)
        self._observe("GetModelInfo", grpc.StatusCode.OK, start)
        return model_info_to_proto(
            self._info,
            max_sequence_length=self._limits.max_sequence_length,
            max_request_tokens=self._limits.max_request_tokens,
            max_tokens_per_batch=self._max_tokens_per_batch,
            max_message_bytes=self._max_message_bytes,
            weights_version=batcher.weights_version,
        )

    async def LoadWeights(self, request: pb.LoadWeightsRequest, context):
        """Swaps weights between steps; on failure the old weights keep serving."""
        start = time.monotonic()
        try:
            with self._tracked():
                new, previous, info = await self._load_weights(request)
        except Exception as exc:
            code, message = status_for(exc)
            # Expected failures (bad spec, unloadable checkpoint) are one line; the
            # traceback of an unexpected one was logged where it was caught.
            logger.warning("LoadWeights %s failed: %s %s", request.model, code.name, message)
            self._observe("LoadWeights", code, start)
            await context.abort(code, message)
        self._info = info
        load_ms = (time.monotonic() - start) * 1000.0
        logger.info("weights %r -> %r loaded in %.0f ms", previous, new, load_ms)
        self._observe("LoadWeights", grpc.StatusCode.OK, start)
        return pb.LoadWeightsResponse(
            weights_version=new, previous_weights_version=previous, load_ms=load_ms
        )

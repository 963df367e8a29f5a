"""Thin async servicer of ``megascore.v1.Scorer``: validate, convert, await, convert back.

No torch here: the engine sits behind the :class:`DynamicBatcher`. Errors are
mapped to status codes by :func:`megascore_server.status.status_for` only.
"""

from __future__ import annotations

import asyncio
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


class ScorerServicer(pb_grpc.ScorerServicer):
    """``megascore.v1.Scorer`` on top of a :class:`DynamicBatcher`.

    Every RPC answers UNAVAILABLE (:data:`LOADING_MESSAGE`) until :meth:`attach`
    gives it the engine's batcher, so the server can start while the model loads.

    Args:
        health: health servicer; requests are refused while it is not SERVING.
        max_tokens_per_batch: step budget, reported in ``ModelInfo``.
        max_stream_inflight: ScoreStream messages submitted ahead of their responses.
        metrics: optional Prometheus metrics.
    """

    def __init__(
        self,
        health: ScorerHealth,
        *,
        max_tokens_per_batch: int,
        max_stream_inflight: int = 32,
        metrics: ServerMetrics | None = None,
    ):
        self._health = health
        self._max_tokens_per_batch = max_tokens_per_batch
        self._max_stream_inflight = max_stream_inflight
        self._metrics = metrics
        self._batcher: DynamicBatcher | None = None
        self._limits: RequestLimits | None = None
        self._info: ModelInfo | None = None

    def attach(self, batcher: DynamicBatcher, limits: RequestLimits, info: ModelInfo) -> None:
        """Serves the engine behind ``batcher`` (its limits and model description)."""
        self._batcher, self._limits, self._info = batcher, limits, info

    def _ready(self) -> DynamicBatcher:
        if self._batcher is None:
            raise UnavailableError(LOADING_MESSAGE)
        return self._batcher

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
        try:
            response = await self._score_one(request, request_id, arrival, context.time_remaining())
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

        reader = asyncio.ensure_future(read())
        try:
            while (item := await queue.get()) is not None:
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
        finally:
            reader.cancel()
            while not queue.empty():
                item = queue.get_nowait()
                if item is None:
                    continue
                task = item[2]
                if not task.done():
                    task.cancel()  # the batcher drops it
                elif not task.cancelled():
                    task.exception()  # retrieved: a later failure is not logged as lost

    async def GetModelInfo(self, request, context: grpc.aio.ServicerContext):
        """The model, its current weights version and the server's limits."""
        start = time.monotonic()
        try:
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
            weights_version=batcher.weights_version,
        )

    async def LoadWeights(self, request: pb.LoadWeightsRequest, context):
        """Swaps weights between steps; on failure the old weights keep serving."""
        start = time.monotonic()
        try:
            batcher = self._ready()
            if not request.model:
                raise InvalidRequestError(
                    "model: required ('hf:DIR', 'megatron:DIR' or 'builtin:NAME@SEED')"
                )
            logger.info("loading weights %s (version %r)", request.model, request.weights_version)
            previous = batcher.weights_version
            try:
                new, previous, info = await batcher.load_weights(
                    request.model, request.weights_version
                )
            except CheckpointError as exc:
                raise CheckpointError(f"{exc.reason}; still serving weights {previous!r}") from exc
            except MegascoreError:
                raise
            except Exception as exc:
                raise CheckpointError(
                    f"loading {request.model} failed ({type(exc).__name__}: {exc}); "
                    f"still serving weights {previous!r}"
                ) from exc
        except Exception as exc:
            code, message = status_for(exc)
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

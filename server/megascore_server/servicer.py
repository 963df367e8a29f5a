"""Thin async servicer of ``megascore.v1.Scorer``: validate, convert, await, convert back.

No torch here: the engine sits behind the :class:`DynamicBatcher`. Methods raise
typed errors; :class:`megascore_server.status.StatusInterceptor` turns them into
statuses, logs and counts them. Whether a call may run is asked of the
:class:`megascore_server.gate.CallGate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import grpc

from megascore.errors import CheckpointError, MegascoreError, UnavailableError, clip, quoted
from megascore.types import Limits, ModelInfo
from megascore.v1 import scoring_pb2 as pb
from megascore.v1 import scoring_pb2_grpc as pb_grpc
from megascore_server.batcher import DynamicBatcher
from megascore_server.convert import build_response, model_info_to_proto
from megascore_server.gate import SHUTTING_DOWN_MESSAGE, CallGate
from megascore_server.status import request_label
from megascore_server.validation import validate_load_request, validate_request
from megascore_server.weight_push import WeightPusher

logger = logging.getLogger(__name__)

_DRAIN = object()  # wakes an open ScoreStream when the drain begins


def _new_request_id() -> str:
    return "srv-" + uuid.uuid4().hex[:16]


class ScorerServicer(pb_grpc.ScorerServicer):
    """``megascore.v1.Scorer`` on top of a :class:`DynamicBatcher`.

    Every RPC answers UNAVAILABLE until :meth:`attach` gives it the engine's batcher
    and the gate lets calls in (:class:`megascore_server.gate.CallGate`).

    Args:
        gate: admission, readiness and the count of running calls.
        max_tokens_per_batch: step budget, reported in ``ModelInfo``.
        max_message_bytes: the gRPC server's message size limit (both directions),
            reported in ``ModelInfo`` so that clients split batches under it.
        max_stream_inflight: ScoreStream messages submitted ahead of their responses.
    """

    def __init__(
        self,
        gate: CallGate,
        *,
        max_tokens_per_batch: int,
        max_message_bytes: int,
        max_stream_inflight: int = 32,
    ):
        self._gate = gate
        self._max_tokens_per_batch = max_tokens_per_batch
        self._max_message_bytes = max_message_bytes
        self._max_stream_inflight = max_stream_inflight
        self._batcher: DynamicBatcher | None = None
        self._limits: Limits | None = None
        self._info: ModelInfo | None = None
        self._pusher = WeightPusher()

    def attach(self, batcher: DynamicBatcher, limits: Limits, info: ModelInfo) -> None:
        """Serves the engine behind ``batcher`` (its limits and model description)."""
        self._batcher, self._limits, self._info = batcher, limits, info

    async def _score(
        self, request: pb.ScoreRequest, request_id: str, arrival: float, remaining: float | None
    ) -> pb.ScoreResponse:
        self._gate.check()
        batch = validate_request(request, self._limits)
        deadline = None if remaining is None else arrival + remaining
        result = await self._batcher.submit(request_id, batch, arrival=arrival, deadline=deadline)
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
        request_label.set(clip(request_id))
        async with self._gate.call():
            return await self._score(request, request_id, arrival, context.time_remaining())

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
                    label = f"{clip(request_id)} (stream message {index})"
                    remaining = context.time_remaining()
                    task = asyncio.ensure_future(
                        self._score(request, request_id, arrival, remaining)
                    )
                    queue.put_nowait((label, task))
                    index += 1
            except Exception as exc:
                reader_error.append(exc)
            finally:
                queue.put_nowait(None)

        async with self._gate.call():
            reader = asyncio.ensure_future(read())
            try:
                with self._gate.waking(lambda: queue.put_nowait(_DRAIN)):
                    responses = self._stream_responses(queue, slots)
                    async with contextlib.aclosing(responses):
                        async for response in responses:
                            yield response
                if reader_error:
                    request_label.set("")
                    raise reader_error[0]
            finally:
                reader.cancel()
                _cancel_queued(queue)

    async def _stream_responses(self, queue: asyncio.Queue, slots: asyncio.Semaphore):
        while True:
            if self._gate.draining and queue.empty():
                # Idle (every answer sent): end the stream now rather than hold the drain.
                request_label.set("")
                raise UnavailableError(SHUTTING_DOWN_MESSAGE)
            item = await queue.get()
            if item is None:
                return
            if item is _DRAIN:  # wakes an idle stream for the check above
                continue
            label, task = item
            request_label.set(label)
            try:
                response = await task
            finally:
                slots.release()
            yield response

    async def GetModelInfo(self, request, context: grpc.aio.ServicerContext):
        """The model, its current weights version and the server's limits."""
        await self._gate.admit()
        self._gate.check(serving=False)
        return model_info_to_proto(
            self._info,
            self._limits,
            max_tokens_per_batch=self._max_tokens_per_batch,
            max_message_bytes=self._max_message_bytes,
            weights_version=self._batcher.weights_version,
        )

    async def LoadWeights(self, request: pb.LoadWeightsRequest, context):
        """Loads weights between steps; a refused checkpoint leaves the old ones serving
        (a read failing midway breaks the replica: docs/checkpoints.md, Hot reload)."""
        start = time.monotonic()
        async with self._gate.call():
            self._gate.check(serving=False)
            new, previous, info = await self._load_weights(request)
        self._pusher.forget_kept()
        self._info = info
        load_ms = (time.monotonic() - start) * 1000.0
        logger.info("weights %r -> %r loaded in %.0f ms", previous, new, load_ms)
        return pb.LoadWeightsResponse(
            weights_version=new, previous_weights_version=previous, load_ms=load_ms
        )

    async def _load_weights(self, request: pb.LoadWeightsRequest) -> tuple[str, str, ModelInfo]:
        validate_load_request(request)
        model = quoted(request.model)
        logger.info("loading weights %s (version %r)", model, request.weights_version)
        previous = self._batcher.weights_version
        try:
            return await self._batcher.load_weights(request.model, request.weights_version)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc.reason}; still serving weights {previous!r}") from exc
        except MegascoreError:
            raise
        except Exception as exc:
            logger.error("LoadWeights %s: unexpected error", model, exc_info=exc)
            raise CheckpointError(
                f"loading {model} failed ({type(exc).__name__}: {clip(str(exc))}); "
                f"still serving weights {previous!r}"
            ) from exc

    async def UpdateWeights(self, request_iterator, context):
        """Stages pushed weights on every rank, then swaps them in (``weight_push``)."""
        async with self._gate.call():
            self._gate.check(serving=False)
            response, info = await self._pusher.push(request_iterator, self._batcher)
        self._info = info or self._info
        return response

    async def FinishWeightUpdate(self, request: pb.FinishWeightUpdateRequest, context):
        """Commits or aborts the push an UpdateWeights prepared (``weight_push``)."""
        async with self._gate.call():
            self._gate.check(serving=False)
            response, info = await self._pusher.finish(
                request.push_id, request.commit, self._batcher
            )
        self._info = info or self._info
        return response


def _cancel_queued(queue: asyncio.Queue) -> None:
    """Cancels the stream messages submitted but not answered (the batcher drops them)."""
    while not queue.empty():
        item = queue.get_nowait()
        if item is None or item is _DRAIN:
            continue
        task = item[1]
        if not task.done():
            task.cancel()
        elif not task.cancelled():
            task.exception()  # retrieved: a later failure is not logged as lost

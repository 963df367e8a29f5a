"""The gRPC front: ``megascore.v1.Scorer`` decoded into the scoring service and back.

Only protobuf <-> domain translation lives here (:mod:`megascore_server.validation`
decodes a ``ScoreRequest``, :mod:`megascore_server.convert` encodes the answer); what a
call may do and how it is scored is :class:`megascore_server.service.ScoringService`'s.
No torch here. Methods raise typed errors;
:class:`megascore_server.status.StatusInterceptor` turns them into statuses, logs and
counts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import numpy as np

from megascore.api.errors import UnavailableError, clip
from megascore.api.wire import decode_array, encode_array
from megascore.v1 import scoring_pb2 as pb
from megascore.v1 import scoring_pb2_grpc as pb_grpc
from megascore_server.convert import build_response, model_info_to_proto
from megascore_server.gate import SHUTTING_DOWN_MESSAGE
from megascore_server.memory_trim import MemoryTrim
from megascore_server.service import ScoringService, new_request_id
from megascore_server.status import request_label
from megascore_server.validation import validate_request

_DRAIN = object()  # wakes an open ScoreStream when the drain begins
_INT_DTYPES = (pb.DTYPE_INT32, pb.DTYPE_INT64)


class ScorerServicer(pb_grpc.ScorerServicer):
    """``megascore.v1.Scorer`` on top of a :class:`ScoringService`.

    Args:
        service: the data plane (every RPC answers UNAVAILABLE until an engine is
            attached to it and its gate lets calls in).
        max_stream_inflight: ScoreStream messages submitted ahead of their responses
            being written.
        memory: told when a stream whose reads waited for a slot ends (the server's
            :class:`~megascore_server.memory_trim.MemoryTrim`: what its client sent
            meanwhile filled grpc's receive window).
    """

    def __init__(
        self,
        service: ScoringService,
        *,
        max_stream_inflight: int = 32,
        memory: MemoryTrim | None = None,
    ):
        self._service = service
        self._gate = service.gate
        self._max_stream_inflight = max_stream_inflight
        self._memory = memory

    async def _score(
        self, request: pb.ScoreRequest, request_id: str, arrival: float, remaining: float | None
    ) -> pb.ScoreResponse:
        self._gate.check()
        batch = validate_request(request, self._service.limits)
        deadline = None if remaining is None else arrival + remaining
        scored = await self._service.score(batch, request_id, arrival=arrival, deadline=deadline)
        timings = pb.Timings(
            queue_ms=scored.queue_ms,
            compute_ms=scored.compute_ms,
            num_steps=scored.num_steps,
            total_ms=scored.total_ms,
        )
        return build_response(request.request_id, scored.batch, scored.output, timings)

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext):
        """Scores one request (merged with concurrent ones by the batcher)."""
        arrival = time.monotonic()
        request_id = request.request_id or new_request_id()
        request_label.set(clip(request_id))
        async with self._gate.call():
            return await self._score(request, request_id, arrival, context.time_remaining())

    async def ScoreStream(self, request_iterator, context: grpc.aio.ServicerContext):
        """One response per request message, in order; the first error ends the stream."""
        slots = asyncio.Semaphore(self._max_stream_inflight)
        queue: asyncio.Queue = asyncio.Queue()
        reader_error: list[BaseException] = []
        waited = False  # a read waited for a slot: grpc buffered what the client sent

        async def read() -> None:
            nonlocal waited
            index = 0
            try:
                async for request in request_iterator:
                    waited = waited or slots.locked()
                    await slots.acquire()
                    arrival = time.monotonic()
                    request_id = request.request_id or new_request_id()
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
                if waited and self._memory is not None:
                    self._memory.soon()

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
            yield await task
            # Pulled again once the interceptor wrote the answer: only now is its slot
            # free, so a stream that does not read holds at most max_stream_inflight
            # answers, computed or waiting for the client's flow-control window.
            slots.release()

    async def GetModelInfo(self, request, context: grpc.aio.ServicerContext):
        """The model, its current weights version and the server's limits."""
        described = await self._service.describe()
        return model_info_to_proto(
            described.info,
            described.limits,
            max_tokens_per_batch=described.max_tokens_per_batch,
            max_message_bytes=described.max_message_bytes,
            weights_version=described.weights_version,
        )

    async def LoadWeights(self, request: pb.LoadWeightsRequest, context):
        """Loads weights between steps (:meth:`ScoringService.load_weights`)."""
        loaded = await self._service.load_weights(
            request.model, request.weights_version, request.weight_set, request.adapter
        )
        return pb.LoadWeightsResponse(
            weights_version=loaded.weights_version,
            previous_weights_version=loaded.previous_weights_version,
            load_ms=loaded.load_ms,
        )

    async def UpdateWeights(self, request_iterator, context):
        """Stages pushed weights on every rank, then swaps them in (``megascore_server.push``)."""
        return await self._service.push_weights(request_iterator)

    async def FinishWeightUpdate(self, request: pb.FinishWeightUpdateRequest, context):
        """Commits or aborts the push an UpdateWeights prepared (``megascore_server.push``)."""
        return await self._service.finish_push(request.push_id, request.commit)

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        """Token ids of texts with the server's tokenizer."""
        await self._gate.admit()
        ids = self._service.tokenize(list(request.texts), request.add_special_tokens)
        flat = np.fromiter((i for row in ids for i in row), np.int64)
        return pb.TokenizeResponse(
            token_ids=encode_array(flat),
            lengths=encode_array(np.array([len(row) for row in ids], np.int64)),
        )

    async def Detokenize(self, request: pb.DetokenizeRequest, context):
        """Texts and token strings of ids with the server's tokenizer."""
        await self._gate.admit()
        ids = decode_array(request.token_ids, "token_ids", _INT_DTYPES).astype(np.int64)
        if request.HasField("lengths"):
            lengths = decode_array(request.lengths, "lengths", _INT_DTYPES).astype(np.int64)
        else:
            lengths = np.array([ids.size], np.int64)
        texts, tokens = self._service.detokenize(ids, lengths, request.skip_special_tokens)
        return pb.DetokenizeResponse(texts=texts, tokens=tokens)


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

"""Asyncio client: :class:`AsyncScoringClient` (``grpc.aio``), same API as the sync one."""

from __future__ import annotations

import asyncio
import time

import grpc

from megascore.v1 import scoring_pb2 as pb
from megascore.v1 import scoring_pb2_grpc as pb_grpc
from megascore_client import health as health_codec
from megascore_client.batching import Part, ScoreOptions, decode_part, merge
from megascore_client.client import _UNRESOLVED, LOAD_WEIGHTS_TIMEOUT_S, ClientBase
from megascore_client.errors import ScoringError, closed_error
from megascore_client.results import HealthStatus, LoadWeightsResult, ModelInfo, ScoreResult
from megascore_client.stream import AsyncScoreStream
from megascore_client.waiting import time_left


class AsyncScoringClient(ClientBase):
    """Asyncio megascore client. Create it inside the event loop that uses it.

    Takes the constructor arguments of :class:`~megascore_client.client.ClientBase`.
    Many ``score`` calls may run concurrently on one client (one channel, HTTP/2
    multiplexing).

    Example:
        >>> async with AsyncScoringClient("127.0.0.1:50051") as client:
        ...     results = await asyncio.gather(*(client.score(b) for b in batches))
    """

    def __init__(self, target: str, **kwargs):
        super().__init__(target, **kwargs)
        self._channel = self.settings.open_aio()
        self._stub = pb_grpc.ScorerStub(self._channel)
        self._health = health_codec.check_callable(self._channel)
        self._limit_lock = asyncio.Lock()
        self._closed = asyncio.Event()  # set by close(); wakes requests waiting

    async def __aenter__(self) -> AsyncScoringClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self, grace: float | None = None) -> None:
        """Closes the channel (calls in flight are cancelled after ``grace`` seconds;
        they, later calls and requests waiting for the server raise ScoringError
        CANCELLED "the client is closed")."""
        self._closed.set()
        await self._channel.close(grace)

    def _cancelled_by_close(self) -> bool:
        """Whether a ``CancelledError`` out of a call comes from :meth:`close` (which
        cancels the calls in flight) rather than from a cancellation of the awaiting
        task: the client is closed and the task is not being cancelled."""
        task = asyncio.current_task()
        return self._closed.is_set() and (task is None or task.cancelling() == 0)

    async def _call(self, method, request, timeout, *, wait: bool = False):
        """One unary call; with ``wait``, re-sent on UNAVAILABLE per ``wait_for_server_s``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        schedule = None
        while True:
            if self._closed.is_set():  # grpc.aio raises a bare UsageError on a closed channel
                raise closed_error()
            try:
                return await method(request, timeout=time_left(deadline), metadata=self._metadata)
            except grpc.RpcError as exc:
                error = ScoringError.from_rpc_error(exc)
            except asyncio.CancelledError:
                if self._cancelled_by_close():  # close() cancelled the call, not the caller
                    raise closed_error() from None
                raise
            schedule = self._server_wait(error, wait, deadline, schedule)
            delay = schedule.next_delay()
            if delay is None:
                raise schedule.gave_up(error)
            if await self._closed_within(delay):
                raise closed_error()

    async def request_token_limit(self) -> int | None:
        """The per-request token limit used for splitting (resolves "auto" once, which
        also learns the server's message size limit, see :attr:`message_limit`)."""
        async with self._limit_lock:
            if self._token_limit is _UNRESOLVED:
                try:
                    info = await self.model_info()
                except ScoringError as exc:
                    info = exc
                self._token_limit = self._limit_from_info(info)
            return self._token_limit

    async def score(
        self,
        sequences,
        *,
        loss_mask=None,
        lengths=None,
        top_k: int = 0,
        temperature: float = 1.0,
        losses=("nll",),
        metrics=(),
        return_logprobs: bool = True,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> ScoreResult:
        """Scores a batch; arguments, result and errors as ``ScoringClient.score``."""
        start = time.perf_counter()
        options = ScoreOptions(
            top_k=top_k,
            temperature=temperature,
            losses=losses,
            metrics=metrics,
            return_logprobs=return_logprobs,
        )
        limit = await self.request_token_limit()
        parts, rid = self._plan(sequences, loss_mask, lengths, options, request_id, limit)
        result = merge(await self._send(parts, self._deadline(timeout)), rid)
        result.timings.client_ms = (time.perf_counter() - start) * 1e3
        return result

    async def _send(self, parts: list[Part], timeout: float | None) -> list[ScoreResult]:
        semaphore = asyncio.Semaphore(self.max_concurrency)

        async def one(part: Part) -> ScoreResult:
            async with semaphore:
                response = await self._call(self._stub.Score, part.request, timeout, wait=True)
            return decode_part(response, part)

        if len(parts) == 1:
            return [await one(parts[0])]
        tasks = [asyncio.ensure_future(one(part)) for part in parts]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    def stream(self, *, timeout: float | None = None) -> AsyncScoreStream:
        """A ScoreStream helper: ``async with client.stream() as s: f = await s.submit(...)``.

        Args:
            timeout: deadline of the whole stream (default: none). Entering the block
                on a closed client raises ScoringError CANCELLED ("the client is closed").
        """
        return AsyncScoreStream(self, timeout=timeout)

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """Describes the served model and its limits (waits like ``score``)."""
        msg = await self._call(
            self._stub.GetModelInfo, pb.GetModelInfoRequest(), self._deadline(timeout), wait=True
        )
        return ModelInfo.from_proto(msg)

    async def load_weights(
        self, model: str, weights_version: str = "", *, timeout: float | None = None
    ) -> LoadWeightsResult:
        """Asks the server to load new weights (see ``ScoringClient.load_weights``; never
        re-sent by ``wait_for_server_s``)."""
        request = pb.LoadWeightsRequest(model=model, weights_version=weights_version)
        msg = await self._call(
            self._stub.LoadWeights, request, LOAD_WEIGHTS_TIMEOUT_S if timeout is None else timeout
        )
        return LoadWeightsResult.from_proto(msg)

    async def health(self, service: str = "", *, timeout: float | None = None) -> HealthStatus:
        """Runs the ``grpc.health.v1`` check (see ``ScoringClient.health``)."""
        if self._closed.is_set():
            raise closed_error()
        try:
            data = await self._health(
                health_codec.encode_request(service),
                timeout=self._deadline(timeout),
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.NOT_FOUND:
                return health_codec.not_found_status()
            raise ScoringError.from_rpc_error(exc) from None
        except asyncio.CancelledError:
            if self._cancelled_by_close():
                raise closed_error() from None
            raise
        return health_codec.decode_response(data)

    async def wait_until_serving(
        self, timeout: float = 60.0, interval: float = 0.5
    ) -> HealthStatus:
        """Polls ``health()`` until SERVING (see ``ScoringClient.wait_until_serving``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                status = await self.health(timeout=max(0.1, min(5.0, deadline - loop.time())))
                if status.serving:
                    return status
                last = status.status
            except ScoringError as exc:
                if self._closed.is_set():  # closed before or during the probe
                    raise closed_error() from None
                last = str(exc)
            if loop.time() + interval > deadline:
                raise ScoringError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{self.target} not SERVING after {timeout:.1f}s (last: {last})",
                )
            if await self._closed_within(interval):
                raise closed_error()

    async def _closed_within(self, delay: float) -> bool:
        """Sleeps ``delay`` seconds or until :meth:`close`; True when the client is closed."""
        closed = asyncio.get_running_loop().create_task(self._closed.wait())
        try:
            await asyncio.wait([closed], timeout=delay)
        finally:
            closed.cancel()
        return self._closed.is_set()

"""Asyncio client: :class:`AsyncScoringClient` (``grpc.aio``), same API as the sync one."""

from __future__ import annotations

import asyncio
import inspect
import time

from megascore.v1 import scoring_pb2 as pb
from megascore_client import health as health_codec
from megascore_client.client import ScoringClient
from megascore_client.client_base import (
    LOAD_PROGRESS_INTERVAL_S,
    LOAD_WEIGHTS_TIMEOUT_S,
    UNRESOLVED,
    ClientBase,
    LoadProgress,
    finish_score,
)
from megascore_client.errors import ScoringError, closed_error
from megascore_client.push.client_methods import AsyncPushMethods
from megascore_client.results import HealthStatus, LoadWeightsResult, ModelInfo, ScoreResult
from megascore_client.routing import Resend
from megascore_client.splitting import Part, decode_part
from megascore_client.stream import AsyncScoreStream
from megascore_client.text import AsyncTextMethods
from megascore_client.trainer_layouts import PaddedLayout
from megascore_client.transport import AsyncTransport

__all__ = ["AsyncScoringClient"]


class AsyncScoringClient(AsyncTextMethods, AsyncPushMethods, ClientBase):
    """Asyncio megascore client. Create it inside the event loop that uses it.

    Takes the constructor arguments of :class:`~megascore_client.client_base.ClientBase`.
    Many ``score`` calls may run concurrently on one client (one channel, HTTP/2
    multiplexing). ``transport`` is the
    :class:`~megascore_client.transport.AsyncTransport` every call and stream goes through.

    Example:
        >>> async with AsyncScoringClient("127.0.0.1:50051") as client:
        ...     results = await asyncio.gather(*(client.score(b) for b in batches))
    """

    def _open(self) -> None:
        self.transport = AsyncTransport(self.settings)
        self.replica_transports = [AsyncTransport(s) for s in self.replica_settings]
        self._limit_lock = asyncio.Lock()

    async def __aenter__(self) -> AsyncScoringClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self, grace: float | None = None) -> None:
        """Closes the channel (calls in flight are cancelled after ``grace`` seconds;
        they, later calls and requests waiting for the server raise ScoringError
        CANCELLED "the client is closed")."""
        await self.transport.close(grace)
        for transport in self.replica_transports:
            await transport.close(grace)

    async def _unary(self, method, request, deadline, *, wait: bool = False):
        """One unary call; with ``wait``, re-sent on UNAVAILABLE per ``wait_for_server_s``."""
        schedule = error = None
        while True:
            if error is not None:
                schedule, delay = self._resend_delay(error, wait, deadline, schedule, request)
                if await self.transport.sleep(delay):
                    raise closed_error()
            try:
                response = await self.transport.call(method, request, deadline)
            except ScoringError as exc:
                error = exc
            else:
                self._tell_wait(schedule, None)
                return response

    async def request_token_limit(self) -> int | None:
        """The per-request token limit used for splitting (resolves "auto" once, which
        also learns the server's message size limit, see :attr:`message_limit`)."""
        async with self._limit_lock:
            if self._token_limit is UNRESOLVED:
                try:
                    await self.model_info()
                except ScoringError as exc:
                    self._lookup_failed(exc)
            return self._token_limit

    async def score(self, sequences, *, timeout: float | None = None, **arguments) -> ScoreResult:
        """Scores a batch; arguments (those of ``ScoringClient.score``), result and errors
        as ``ScoringClient.score``."""
        start = time.perf_counter()
        limit = await self.request_token_limit()
        parts, rid = self.prepare_call(sequences, arguments, limit)
        return finish_score(await self._send(parts, timeout), rid, start)

    async def _send(self, parts: list[Part], timeout: float | None) -> list[ScoreResult]:
        semaphore = asyncio.Semaphore(self.max_concurrency)

        async def one(part: Part) -> ScoreResult:
            with part.located():
                async with semaphore:
                    response = await self._score_part(part, self._deadline(timeout))
                return decode_part(response, part)

        if len(parts) == 1:
            return [await one(parts[0])]
        tasks = [asyncio.ensure_future(one(part)) for part in parts]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def _score_part(self, part: Part, deadline):
        """Sends the Score request of ``part`` to its replica (``ClientBase._route``),
        re-sent per :meth:`ClientBase._before_resend` until answered (or raises)."""
        state, error, route = Resend(), None, None
        while True:
            if error is not None:
                delay = self._before_resend(error, route, state, deadline, part.request)
                if delay and await self.transport.sleep(delay):
                    raise closed_error()
            route = self._route(part, state.avoid)
            try:
                response = await route.transport.call(
                    route.transport.stub.Score, part.request, deadline, route.metadata
                )
            except ScoringError as exc:
                self._release(route, exc)
                error = exc
            except BaseException:
                self._release(route)
                raise
            else:
                self._release(route)
                self._tell_wait(state.schedule, None)
                return response

    async def _score_layout(self, layout: PaddedLayout, kwargs: dict):
        scored = None
        if layout.sequences:
            scored = await self.score(layout.sequences, **layout.score_arguments(kwargs))
        return layout.answer(scored, kwargs)

    def stream(self, *, timeout: float | None = None) -> AsyncScoreStream:
        """A ScoreStream helper: ``async with client.stream() as s: f = await s.submit(...)``.

        Args:
            timeout: deadline of the whole stream (default: none). Entering the block
                on a closed client raises ScoringError CANCELLED ("the client is closed").
        """
        return AsyncScoreStream(self, timeout=timeout)

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """Describes the served model and its limits (see ``ScoringClient.model_info``)."""
        msg = await self._unary(
            self.transport.stub.GetModelInfo,
            pb.GetModelInfoRequest(),
            self._deadline(timeout),
            wait=True,
        )
        return self._learn_limits(ModelInfo.from_proto(msg))

    async def load_weights(
        self,
        model: str,
        weights_version: str = "",
        *,
        weight_set: str = "",
        adapter: str = "",
        timeout: float | None = None,
        progress: LoadProgress | None = None,
    ) -> LoadWeightsResult:
        """Asks the server to load new weights (see ``ScoringClient.load_weights``; never
        re-sent by ``wait_for_server_s``; ``progress(elapsed_s)`` about once a second)."""
        request = pb.LoadWeightsRequest(
            model=model, weights_version=weights_version, weight_set=weight_set, adapter=adapter
        )
        deadline = self._deadline(LOAD_WEIGHTS_TIMEOUT_S if timeout is None else timeout)
        call = self.transport.call(self.transport.stub.LoadWeights, request, deadline)
        if progress is None:
            return LoadWeightsResult.from_proto(await call)
        task = asyncio.ensure_future(call)
        start = time.monotonic()
        try:
            while not (await asyncio.wait([task], timeout=LOAD_PROGRESS_INTERVAL_S))[0]:
                progress(time.monotonic() - start)
        finally:
            task.cancel()  # a no-op once done; cancels the call when the caller is cancelled
        return LoadWeightsResult.from_proto(task.result())

    async def health(self, service: str = "", *, timeout: float | None = None) -> HealthStatus:
        """Runs the ``grpc.health.v1`` check (see ``ScoringClient.health``)."""
        request, deadline = health_codec.encode_request(service), self._deadline(timeout)
        try:
            data = await self.transport.call(self.transport.health_check, request, deadline)
        except ScoringError as exc:
            return health_codec.status_after(exc)
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
            except ScoringError as exc:
                status = self._failed_probe(exc)
            if status.serving:
                return status
            if loop.time() + interval > deadline:
                raise self._not_serving(timeout, status.status)
            if await self.transport.sleep(interval):
                raise closed_error()


# help() and IDEs show the sync client's arguments: one signature for both.
for _name in ("score", "push_weights"):
    getattr(AsyncScoringClient, _name).__signature__ = inspect.signature(
        getattr(ScoringClient, _name)
    )

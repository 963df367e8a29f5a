"""The channel of one client and how calls go through it, shared by unary calls and streams.

A transport owns the ``grpc`` channel, the Scorer stub, the health-check callable, the
call metadata (bearer token) and the closed state. Every call of a client and of its
streams starts here, so that none starts on a closed client (grpcio 1.85 crashes the
process on a call through a closed sync channel; grpc.aio raises a bare ``UsageError``)
and every ``grpc.RpcError`` leaves as a :class:`~megascore_client.errors.ScoringError`.
"""

from __future__ import annotations

import asyncio
import threading

import grpc

from megascore.v1 import scoring_pb2_grpc as pb_grpc
from megascore_client import health as health_codec
from megascore_client.channel import ChannelSettings
from megascore_client.diagnose import explain
from megascore_client.errors import ScoringError, closed_error
from megascore_client.waiting import time_left

__all__ = ["AsyncTransport", "SyncTransport"]


class SyncTransport:
    """The transport of :class:`~megascore_client.ScoringClient` (a ``grpc.Channel``).

    Attributes:
        stub: the ``megascore.v1.Scorer`` stub; its methods are passed to :meth:`start`.
        health_check: the ``grpc.health.v1.Health/Check`` callable (bytes in and out).
        metadata: metadata sent with every call.
    """

    def __init__(self, settings: ChannelSettings):
        self.settings = settings
        self._channel = settings.open_sync()
        self.stub = pb_grpc.ScorerStub(self._channel)
        self.health_check = health_codec.check_callable(self._channel)
        self.metadata = settings.metadata()
        self._closed = threading.Event()  # set by close(); wakes requests waiting
        self._start_lock = threading.Lock()  # no call starts once close() has begun

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def start(self, method, request, deadline: float | None, metadata: tuple = ()):
        """Starts a unary call (``method`` of :attr:`stub` or :attr:`health_check`) and
        returns its future (``metadata``: sent after :attr:`metadata`).

        Raises:
            ScoringError: CANCELLED ("the client is closed") on a closed transport.
        """
        with self._start_lock:
            if self._closed.is_set():
                raise closed_error()
            return method.future(
                request, timeout=time_left(deadline), metadata=self.metadata + metadata
            )

    def result(self, future):
        """Waits for a call started by :meth:`start`; its error as a ``ScoringError``
        (a connection that never came up explained, :func:`~megascore_client.diagnose.explain`).
        An interruption (e.g. KeyboardInterrupt) cancels the call."""
        try:
            return future.result()
        except grpc.RpcError as exc:
            error = ScoringError.from_rpc_error(exc)
            raise (error if self.closed else explain(error, self.settings)) from None
        except BaseException:
            future.cancel()
            raise

    def call(self, method, request, deadline: float | None, metadata: tuple = ()):
        """One unary call, to its answer (errors as for :meth:`start` and :meth:`result`)."""
        return self.result(self.start(method, request, deadline, metadata))

    def open_stream(self, request_iterator, timeout: float | None):
        """Opens a ScoreStream call fed by ``request_iterator`` (refused when closed)."""
        with self._start_lock:
            if self._closed.is_set():
                raise closed_error()
            return self.stub.ScoreStream(request_iterator, timeout=timeout, metadata=self.metadata)

    def sleep(self, delay: float) -> bool:
        """Sleeps ``delay`` seconds or until :meth:`close`; True when closed."""
        return self._closed.wait(delay)

    def close(self) -> None:
        """Closes the channel: calls in flight are cancelled, later calls refused."""
        with self._start_lock:
            self._closed.set()
        self._channel.close()


class AsyncTransport:
    """The transport of :class:`~megascore_client.AsyncScoringClient` (a
    ``grpc.aio.Channel``; create it inside the event loop that uses it).

    Attributes as :class:`SyncTransport`.
    """

    def __init__(self, settings: ChannelSettings):
        self.settings = settings
        self._channel = settings.open_aio()
        self.stub = pb_grpc.ScorerStub(self._channel)
        self.health_check = health_codec.check_callable(self._channel)
        self.metadata = settings.metadata()
        self._closed = asyncio.Event()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def check_open(self) -> None:
        """Raises the closed error (CANCELLED) when the transport is closed."""
        if self._closed.is_set():
            raise closed_error()

    def cancelled_by_close(self) -> bool:
        """Whether a ``CancelledError`` out of a call comes from :meth:`close` (which
        cancels the calls in flight) rather than from a cancellation of the awaiting
        task: the transport is closed and the task is not being cancelled."""
        task = asyncio.current_task()
        return self._closed.is_set() and (task is None or task.cancelling() == 0)

    async def call(self, method, request, deadline: float | None, metadata: tuple = ()):
        """One unary call, to its answer (``metadata``: sent after :attr:`metadata`).

        Raises:
            ScoringError: the call failed; CANCELLED ("the client is closed") when the
                transport is closed before or while the call runs.
            asyncio.CancelledError: the awaiting task was cancelled.
        """
        self.check_open()
        try:
            return await method(
                request, timeout=time_left(deadline), metadata=self.metadata + metadata
            )
        except grpc.RpcError as exc:
            error = ScoringError.from_rpc_error(exc)
            if error.code is grpc.StatusCode.DEADLINE_EXCEEDED and not self.closed:
                error = await asyncio.to_thread(explain, error, self.settings)  # may probe
            elif not self.closed:
                error = explain(error, self.settings)
            raise error from None
        except asyncio.CancelledError:
            if self.cancelled_by_close():
                raise closed_error() from None
            raise

    def open_stream(self, timeout: float | None):
        """Opens a ScoreStream call (written with ``write``; refused when closed)."""
        self.check_open()
        return self.stub.ScoreStream(timeout=timeout, metadata=self.metadata)

    async def sleep(self, delay: float) -> bool:
        """Sleeps ``delay`` seconds or until :meth:`close`; True when closed."""
        closed = asyncio.get_running_loop().create_task(self._closed.wait())
        try:
            await asyncio.wait([closed], timeout=delay)
        finally:
            closed.cancel()
        return self._closed.is_set()

    async def close(self, grace: float | None = None) -> None:
        """Closes the channel; calls in flight are cancelled after ``grace`` seconds."""
        self._closed.set()
        await self._channel.close(grace)

"""Streaming helpers for rollout loops: one ``ScoreStream`` bidi call, many batches.

Each ``submit`` returns a future at once; the server answers the requests of a
stream one by one, in order, each response echoing its ``request_id`` (checked
here). A batch over the message limit is split into several requests like
``score`` does, and its future resolves when all of them are answered.

gRPC ends a bidi call with a single status, so a failure (bad input, server
restart) fails the stream: every outstanding future gets the
:class:`~megascore_client.errors.ScoringError`, and later ``submit`` calls raise it.
Streams are not retried; open a new one.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import queue
import threading
from collections.abc import Callable

import grpc

from megascore_client.errors import ScoringError, closed_error, malformed_response
from megascore_client.results import ScoreResult
from megascore_client.splitting import decode_part, merge

__all__ = ["AsyncScoreStream", "ScoreStream"]


class _Assembler:
    """Collects the part results of one submitted batch and reports once."""

    def __init__(self, num_parts: int, request_id: str, on_result: Callable, on_error: Callable):
        self._results: list[ScoreResult | None] = [None] * num_parts
        self._missing = num_parts
        self._request_id = request_id
        self._on_result = on_result
        self._on_error = on_error
        self._failed = False

    def part_done(self, index: int, result: ScoreResult) -> None:
        if self._failed:
            return
        self._results[index] = result
        self._missing -= 1
        if not self._missing:
            self._on_result(merge(self._results, self._request_id))

    def fail(self, error: BaseException) -> None:
        if not self._failed:
            self._failed = True
            self._on_error(error)


def _ended() -> ScoringError:
    """Recorded when a stream ends without error: later submits fail with it."""
    return ScoringError(grpc.StatusCode.CANCELLED, "the stream has ended")


def _task_cancelling() -> bool:
    """Whether the current asyncio task is being cancelled (``task.cancel()``), as
    opposed to a ``CancelledError`` that grpc.aio raises for a cancelled call."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class _Pending:
    """What a stream has sent and not had answered yet, in order, and the error that
    ended the stream (shared by the sync and the asyncio stream; the caller locks)."""

    def __init__(self):
        self.parts: collections.deque = collections.deque()
        self.error: ScoringError | None = None

    def add(self, part, index: int, assembler: _Assembler) -> None:
        self.parts.append((part, index, assembler))

    def check_open(self, closed: bool) -> None:
        """Raises RuntimeError when the stream is ``closed``, its error once it failed."""
        if closed:
            raise RuntimeError("submit on a closed stream")
        if self.error is not None:
            raise self.error

    def resolve(self, response) -> None:
        """Decodes a response as the answer to the oldest part sent."""
        if not self.parts:
            raise malformed_response(f"unexpected response {response.request_id!r}")
        part, index, assembler = self.parts.popleft()
        try:
            assembler.part_done(index, decode_part(response, part))
        except Exception:  # its batch fails with the rest, as the stream ends (_ReadEnd)
            self.parts.appendleft((part, index, assembler))
            raise

    def fail(self, error: ScoringError | None) -> None:
        """Records ``error`` (the first one wins) and fails every outstanding batch."""
        if error is not None and self.error is None:
            self.error = error
        while self.parts:
            _, _, assembler = self.parts.popleft()
            assembler.fail(self.error)

    def end(self, error: ScoringError | None) -> None:
        """The call is over (with ``error``, or None when it ended cleanly)."""
        if error is None and self.parts:
            error = malformed_response(f"stream ended with {len(self.parts)} unanswered")
        self.fail(error or _ended())


class _ReadEnd:
    """Around a stream's response reader: what ended it, as a :class:`ScoringError`.

    The call's status (``grpc.RpcError``), a response that does not fit its request
    (``ScoringError``) or a failure of the SDK's own decoding (any other exception, kept
    as an INTERNAL error naming it): the call is then cancelled, and the outstanding
    futures fail with it rather than wait for a reader that is gone. ``error`` stays None
    when the responses simply ran out.
    """

    def __init__(self, call):
        self.call = call
        self.error: ScoringError | None = None

    def __enter__(self) -> _ReadEnd:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if isinstance(exc, grpc.RpcError):
            self.error = ScoringError.from_rpc_error(exc)
            return True
        if isinstance(exc, Exception):
            self.error = (
                exc
                if isinstance(exc, ScoringError)
                else ScoringError(
                    grpc.StatusCode.INTERNAL,
                    f"the SDK failed reading the stream: {type(exc).__name__}: {exc}",
                )
            )
            self.call.cancel()
            return True
        return False


class ScoreStream:
    """Sync streaming helper; obtain it with ``ScoringClient.stream()``.

    Example:
        >>> with client.stream() as stream:
        ...     futures = [stream.submit(batch, top_k=1) for batch in batches]
        ...     results = [f.result() for f in futures]
    """

    def __init__(self, client, *, timeout: float | None = None):
        self._client = client
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = _Pending()
        self._lock = threading.Lock()
        self._closed = False
        self._call = client.transport.open_stream(self._request_iter(), timeout)
        self._reader = threading.Thread(target=self._read, name="megascore-stream", daemon=True)
        self._reader.start()

    def _request_iter(self):
        while (request := self._requests.get()) is not None:
            yield request

    def __enter__(self) -> ScoreStream:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.cancel()
        self.close()

    def submit(self, sequences, **kwargs) -> concurrent.futures.Future:
        """Queues a batch; returns a ``Future[ScoreResult]``.

        Args:
            sequences: as for ``ScoringClient.score``.
            **kwargs: the keyword arguments of ``score`` except ``timeout``.

        Raises:
            InvalidInputError: bad input (the stream stays usable).
            ScoringError: the stream has failed.
            RuntimeError: the stream is closed.
        """
        limit = self._client.request_token_limit()
        parts, rid = self._client.prepare_call(sequences, kwargs, limit)
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # ordered results: not cancellable one by one
        assembler = _Assembler(len(parts), rid, future.set_result, future.set_exception)
        with self._lock:
            self._pending.check_open(self._closed)
            for index, part in enumerate(parts):
                self._pending.add(part, index, assembler)
                self._requests.put(part.request)
        return future

    def _read(self) -> None:
        with _ReadEnd(self._call) as end:
            for response in self._call:
                with self._lock:
                    self._pending.resolve(response)
        with self._lock:
            self._pending.end(end.error)

    def close(self) -> None:
        """Half-closes the stream and waits until every submitted batch is answered."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._requests.put(None)
        self._reader.join()

    def cancel(self) -> None:
        """Cancels the call; outstanding futures fail with CANCELLED."""
        self._call.cancel()


class AsyncScoreStream:
    """Asyncio streaming helper; obtain it with ``AsyncScoringClient.stream()``.

    Example:
        >>> async with aclient.stream() as stream:
        ...     future = await stream.submit([[1, 2, 3]])
        ...     result = await future
    """

    def __init__(self, client, *, timeout: float | None = None):
        self._client = client
        self._timeout = timeout
        self._pending = _Pending()
        self._write_lock = asyncio.Lock()
        self._closed = False
        self._call = None
        self._reader: asyncio.Task | None = None

    async def __aenter__(self) -> AsyncScoreStream:
        self._call = self._client.transport.open_stream(self._timeout)
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.cancel()
        await self.close()

    async def submit(self, sequences, **kwargs) -> asyncio.Future:
        """Sends a batch; returns an ``asyncio.Future[ScoreResult]`` (await it).

        Args and raises as for :meth:`ScoreStream.submit`.
        """
        if self._call is None:
            raise RuntimeError("use the stream as 'async with client.stream() as stream'")
        limit = await self._client.request_token_limit()
        parts, rid = self._client.prepare_call(sequences, kwargs, limit)
        future = asyncio.get_running_loop().create_future()

        def on_result(result: ScoreResult) -> None:
            if not future.done():
                future.set_result(result)

        def on_error(exc: BaseException) -> None:
            if not future.done():
                future.set_exception(exc)
                future.exception()  # consumed: the caller may stop awaiting a failed stream

        assembler = _Assembler(len(parts), rid, on_result, on_error)
        async with self._write_lock:
            self._pending.check_open(self._closed)
            for index, part in enumerate(parts):
                self._pending.add(part, index, assembler)
                try:
                    await self._call.write(part.request)
                except grpc.RpcError as exc:
                    self._pending.fail(ScoringError.from_rpc_error(exc))
                    raise self._pending.error from None
                except (asyncio.InvalidStateError, asyncio.CancelledError):
                    if _task_cancelling():
                        raise
                    await asyncio.shield(self._reader)  # the call ended: the reader knows why
                    raise self._pending.error from None
        return future

    async def _read(self) -> None:
        with _ReadEnd(self._call) as end:
            try:
                while (response := await self._call.read()) is not grpc.aio.EOF:
                    self._pending.resolve(response)
            except asyncio.CancelledError:
                # grpc.aio raises it for a call cancelled here: by cancel() or by the
                # client's close(); a cancellation of this task itself goes on
                end.error = self._cancelled_error()
                if _task_cancelling():
                    self._pending.fail(end.error)
                    raise
        error = end.error
        if error is None and not self._pending.parts and self._call.done():
            code = await self._call.code()
            if code is not grpc.StatusCode.OK:
                error = ScoringError(code, await self._call.details() or code.name)
        self._pending.end(error)

    def _cancelled_error(self) -> ScoringError:
        """The error of a call cancelled on this side: by ``close()`` of the client
        (the closed error) or by :meth:`cancel`."""
        if self._client.transport.closed:
            return closed_error()
        return ScoringError(grpc.StatusCode.CANCELLED, "the stream was cancelled")

    async def close(self) -> None:
        """Half-closes the stream and waits until every submitted batch is answered."""
        async with self._write_lock:
            if not self._closed and self._call is not None:
                self._closed = True
                if not self._call.done():
                    try:
                        await self._call.done_writing()
                    except (grpc.RpcError, asyncio.InvalidStateError, asyncio.CancelledError):
                        if _task_cancelling():
                            raise
                        # the reader reports the call's status
        if self._reader is not None:
            await self._reader

    def cancel(self) -> None:
        """Cancels the call; outstanding futures fail with CANCELLED."""
        if self._call is not None:
            self._call.cancel()

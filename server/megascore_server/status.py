"""Failed calls become gRPC statuses here, and only here.

:data:`megascore_server.error_table.ERROR_TABLE` maps typed errors
(:mod:`megascore.api.errors`) to status codes (and the HTTP front's statuses); their
reason is safe to show the caller. Anything else is a bug or an engine
failure: INTERNAL with a generic message, the traceback in the log.

:class:`StatusInterceptor` applies the table to every Scorer RPC (and counts and
logs each outcome), so servicer methods just raise. It also makes requests that
do not parse an ordinary INVALID_ARGUMENT on every RPC of the server: grpc
deserializes a request before any handler runs and answers a deserializer that
raises with UNKNOWN and an ERROR traceback, so the interceptor swaps each
method's deserializer for one that turns a parse failure into a value, raised
as :class:`UndecodableRequestError` where the handler would receive the request
(for a stream: where the handler reads that message).

User data in messages is cut by :func:`clip` / :func:`quoted`, and a whole
message by :func:`status_for`: a status must fit in the response metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import inspect
import logging
import time
from typing import TYPE_CHECKING

import grpc

from megascore.api.errors import InvalidRequestError, clip
from megascore_server.error_table import INTERNAL_MESSAGE, mapping_for

if TYPE_CHECKING:
    from megascore_server.memory_trim import MemoryTrim
    from megascore_server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 1024
"""Longest status message sent (grpc's default client metadata limit is 8 KiB)."""
DECODE_LOG_EVERY_S = 10.0
"""At most one log line per this many seconds about requests that do not parse."""

SCORER_METHOD_PREFIX = "/megascore.v1.Scorer/"
_EXPECTED = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,
    }
)
"""Failures logged at INFO (the caller's mistake, or a server not serving); others WARNING."""

request_label: contextvars.ContextVar[str] = contextvars.ContextVar("request_label", default="")
"""The request a failure belongs to (``request_id``, or ``"id (stream message i)"``):
set by the servicer in the RPC's task, named by :func:`status_for` in the message."""


class UndecodableRequestError(InvalidRequestError):
    """The request bytes do not parse as the method's request message."""


def status_for(exc: BaseException, request_id: str = "") -> tuple[grpc.StatusCode, str]:
    """Maps an exception to the gRPC status code and message sent to the caller.

    Unmapped exceptions become INTERNAL with a generic message; their traceback
    is logged here, with the request id.

    Args:
        exc: the exception raised while handling a request.
        request_id: id for the log line (and the message, when not empty).

    Returns:
        ``(code, message)``; the message is at most :data:`MAX_MESSAGE_CHARS` long.
    """
    prefix = f"request_id={request_id}: " if request_id else ""
    entry = mapping_for(exc)
    if entry is not None:
        reason = getattr(exc, "reason", str(exc))
        return entry.grpc_code, clip(prefix + reason, MAX_MESSAGE_CHARS)
    logger.error(
        "request_id=%s: unexpected %s", request_id or "-", type(exc).__name__, exc_info=exc
    )
    return grpc.StatusCode.INTERNAL, prefix + INTERNAL_MESSAGE


@dataclasses.dataclass(frozen=True)
class _Undecodable:
    """What the tolerant deserializer returns for bytes that do not parse."""

    message_type: str
    error: str
    num_bytes: int

    def raise_error(self, where: str = "") -> None:
        raise UndecodableRequestError(
            f"request does not parse as {self.message_type}: {where}{clip(self.error, 200)} "
            f"({self.num_bytes} bytes)"
        )


def _tolerant(deserialize, memory: MemoryTrim | None):
    """``deserialize`` returning :class:`_Undecodable` instead of raising; ``memory`` is
    told each message's size."""
    if deserialize is None:
        return None
    descriptor = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    message_type = getattr(descriptor, "full_name", "the request message")

    def parse(data: bytes):
        if memory is not None:
            memory.saw(len(data))
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, or anything else the parser raises
            return _Undecodable(message_type, f"{type(exc).__name__}: {exc}", len(data))

    return parse


async def _parsed(requests):
    """The request stream, raising :class:`UndecodableRequestError` at a bad message."""
    index = 0
    async for request in requests:
        if isinstance(request, _Undecodable):
            request.raise_error(f"stream message {index}: ")
        yield request
        index += 1


async def _write(context, response) -> None:
    """Sends one message of a stream. A write grpc core refuses (the client ended the call
    while the message waited for its flow-control window, e.g. a stream that never read)
    ends the call as cancelled; a yielded message's refused write would escape in grpc's
    own code as an ExecuteBatchError traceback."""
    try:
        await context.write(response)
    except grpc.aio.InternalError:
        raise asyncio.CancelledError from None


def _seconds(response, since: float) -> float:
    """A ScoreResponse carries its own latency (``timings.total_ms``); others: since then."""
    timings = getattr(response, "timings", None)
    if timings is not None and timings.total_ms:
        return timings.total_ms / 1000.0
    return time.monotonic() - since


@dataclasses.dataclass
class _Clock:
    since: float = dataclasses.field(default_factory=time.monotonic)


class _RateLimited:
    """True at most once per ``every_s`` seconds; counts the calls it refused."""

    def __init__(self, every_s: float):
        self._every_s = every_s
        self._next = 0.0
        self.suppressed = 0

    def allow(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            self.suppressed += 1
            return False
        self._next = now + self._every_s
        return True


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Maps, logs and counts the outcome of every call (see the module docstring).

    Put it first in the server's interceptors so that it also sees the calls other
    interceptors refuse (:mod:`megascore_server.auth` raises
    :class:`UnauthenticatedError`).

    Args:
        metrics: counts each Scorer call (and each ScoreStream message) by status code.
        memory: told the size of each request message (large ones are trimmed after).
    """

    def __init__(self, metrics: ServerMetrics | None = None, memory: MemoryTrim | None = None):
        self._metrics = metrics
        self._memory = memory
        self._decode_log = _RateLimited(DECODE_LOG_EVERY_S)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        rpc = method.rsplit("/", 1)[-1]
        counted = method.startswith(SCORER_METHOD_PREFIX)
        return self._wrap(handler, rpc, counted)

    def _observe(self, rpc: str, counted: bool, code: grpc.StatusCode, since: float) -> None:
        if counted and self._metrics is not None:
            self._metrics.observe_request(rpc, code.name, time.monotonic() - since)

    def _observe_message(self, rpc: str, counted: bool, response, since: float) -> None:
        if counted and self._metrics is not None:
            self._metrics.observe_request(rpc, "OK", _seconds(response, since))

    def _log(self, rpc: str, exc: Exception, code: grpc.StatusCode, message: str) -> None:
        if isinstance(exc, UndecodableRequestError):
            if self._decode_log.allow():
                logger.info(
                    "%s: %s %s (at most one such line per %.0f s; %d suppressed so far)",
                    rpc,
                    code.name,
                    message,
                    DECODE_LOG_EVERY_S,
                    self._decode_log.suppressed,
                )
            return
        level = logging.INFO if code in _EXPECTED else logging.WARNING
        logger.log(level, "%s failed: %s %s", rpc, code.name, message)

    async def _fail(self, rpc, counted, exc: Exception, context, since: float):
        """Answers ``exc`` with its status (never returns)."""
        code, message = status_for(exc, request_label.get())
        self._log(rpc, exc, code, message)
        self._observe(rpc, counted, code, since)
        try:
            await context.abort(code, message)
        except grpc.aio.InternalError as error:  # ExecuteBatchError: the call had ended
            self._not_sent(rpc, code, error)

    def _not_sent(self, rpc: str, code: grpc.StatusCode, error: Exception) -> None:
        """A status that grpc core could not send: the call had already ended on the
        client's side (cancelled, or its deadline passed while the handler ran) before
        grpc's own cancellation noticed. One log line and a count, then the call ends
        as cancelled (grpc ends a cancelled handler quietly; the error itself would
        escape with a traceback)."""
        logger.info(
            "%s request_id=%s: status %s not sent, the call had already ended (%s)",
            rpc,
            request_label.get() or "-",
            code.name,
            type(error).__name__,
        )
        if self._metrics is not None:
            self._metrics.status_not_sent.labels(rpc=rpc, code=code.name).inc()
        raise asyncio.CancelledError

    def _cancelled(self, rpc: str, counted: bool, since: float) -> None:
        logger.info("%s request_id=%s cancelled by the client", rpc, request_label.get() or "-")
        self._observe(rpc, counted, grpc.StatusCode.CANCELLED, since)

    @contextlib.asynccontextmanager
    async def _outcome(self, rpc: str, counted: bool, context):
        """Answers, logs and counts whatever the call raises inside; yields its clock
        (``since``: the call's start, or for a stream the last message sent)."""
        clock = _Clock()
        try:
            yield clock
        except asyncio.CancelledError:
            self._cancelled(rpc, counted, clock.since)
            raise
        except grpc.aio.AbortError:  # answered already
            raise
        except Exception as exc:
            await self._fail(rpc, counted, exc, context, clock.since)

    def _wrap(self, handler: grpc.RpcMethodHandler, rpc: str, counted: bool):
        inner = (
            handler.unary_unary or handler.unary_stream or handler.stream_unary
        ) or handler.stream_stream

        def adapt(request):
            if not handler.request_streaming:
                if isinstance(request, _Undecodable):
                    request.raise_error()
                return request
            return _parsed(request)

        async def unary_response(request, context):
            async with self._outcome(rpc, counted, context) as clock:
                response = await inner(adapt(request), context)
            self._observe(rpc, counted, grpc.StatusCode.OK, clock.since)
            return response

        async def stream_response(request, context):
            async with self._outcome(rpc, counted, context) as clock:
                result = inner(adapt(request), context)
                if not inspect.isasyncgen(result):  # writes with context.write()
                    await result
                    return
                async with contextlib.aclosing(result):
                    async for response in result:
                        self._observe_message(rpc, counted, response, clock.since)
                        await _write(context, response)
                        clock.since = time.monotonic()

        kwargs = {
            "request_deserializer": _tolerant(handler.request_deserializer, self._memory),
            "response_serializer": handler.response_serializer,
        }
        if handler.response_streaming:
            make = (
                grpc.stream_stream_rpc_method_handler
                if handler.request_streaming
                else grpc.unary_stream_rpc_method_handler
            )
            return make(stream_response, **kwargs)
        make = (
            grpc.stream_unary_rpc_method_handler
            if handler.request_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        return make(unary_response, **kwargs)

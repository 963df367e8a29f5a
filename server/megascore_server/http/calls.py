"""What every HTTP route shares: admission, deadline, disconnect, metrics, errors.

:func:`run` runs one route's work inside the service's gate (counted as running, so a
drain waits for it), bounded by the ``X-Request-Timeout`` header (seconds; 504 when it
passes) and cancelled when the client disconnects (the batcher then drops the queued
work); whatever it raises becomes an OpenAI-shaped error
(:func:`megascore_server.http.errors.error_response`); every call is counted in the
server's metrics under ``front="http"`` and its route.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from megascore_server.http.errors import DeadlineExceeded, HttpError, error_response
from megascore_server.metrics import ServerMetrics
from megascore_server.service import ScoringService

logger = logging.getLogger(__name__)

TIMEOUT_HEADER = "x-request-timeout"


def request_timeout(request: Request) -> float | None:
    """Seconds the caller gives the request (``X-Request-Timeout``), or None.

    Raises:
        HttpError: 400 for a value that is not a positive number.
    """
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise HttpError(400, f"X-Request-Timeout: {raw[:32]!r} is not a positive number of seconds")
    return value


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _bounded(request: Request, work: Awaitable, timeout: float | None):
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait(
            {task, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        watcher.cancel()
    if task in done:
        if task.cancelled() and timeout is not None:
            # The batcher drops a queued request whose deadline passed (a cancel).
            raise DeadlineExceeded(f"X-Request-Timeout of {timeout:g} s passed before the answer")
        return task.result()
    task.cancel()
    if watcher in done:
        raise asyncio.CancelledError("client disconnected")
    raise DeadlineExceeded(f"X-Request-Timeout of {timeout:g} s passed before the answer")


async def run(
    request: Request,
    route: str,
    service: ScoringService,
    metrics: ServerMetrics,
    work: Callable[[float, float | None], Awaitable[Response]],
    *,
    fields: dict[str, str] | None = None,
    gated: bool = True,
) -> Response:
    """Runs ``work(arrival, deadline)`` for ``route`` with every shared guarantee.

    Args:
        request: the HTTP request (its body already read).
        route: the metrics label.
        service: the scoring service (its gate admits and counts the call).
        metrics: the server's metrics.
        work: builds the response; raises typed errors.
        fields: domain field name -> the dialect's, for the error's ``param``.
        gated: counted as a running call (False for probes and metadata).
    """
    arrival = time.monotonic()
    status = 499
    try:
        timeout = request_timeout(request)
        deadline = None if timeout is None else arrival + timeout
        if gated:
            async with service.call():
                service.gate.check()  # loading / draining: 503 before any decoding
                response = await _bounded(request, work(arrival, deadline), timeout)
        else:
            response = await work(arrival, deadline)
        status = response.status_code
        return response
    except asyncio.CancelledError:
        logger.info("http %s cancelled: the client disconnected", route)
        raise
    except Exception as exc:
        response = error_response(exc, fields=fields)
        status = response.status_code
        level = logging.WARNING if status >= 500 else logging.INFO
        logger.log(level, "http %s failed: %d %s", route, status, bytes(response.body)[:300])
        return response
    finally:
        metrics.observe_request(route, str(status), time.monotonic() - arrival, front="http")

"""What the HTTP front checks before any route runs: the bearer token and the body size.

A plain ASGI middleware (not Starlette's ``BaseHTTPMiddleware``, which sits between a
route and the client's disconnect and costs a task per call):

* a missing or wrong ``Authorization: Bearer`` is a 401 on every path but the probes;
* a body over the limit is a 413, whether its ``Content-Length`` says so or it arrives
  chunked without one (the body is read here, never more than the limit plus one chunk,
  and handed on to the route; later ``receive`` calls reach the client, so a route still
  hears a disconnect);
* a body is JSON whatever its ``Content-Type`` says (``curl -d`` sends a form type).

Refusals are answered in OpenAI's error shape and counted under their route, or
``other`` for a path no route has (bounded metric labels).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from megascore.api.errors import UnauthenticatedError
from megascore_server.http.errors import HttpError, error_response
from megascore_server.metrics import ServerMetrics

OPEN_PATHS = ("/health", "/health_generate", "/ping")
"""Answered without the bearer token (probes), as gRPC health is."""


class Guard:
    """ASGI middleware in front of the routes.

    Args:
        app: the routes' ASGI app.
        metrics: counts refusals (``front="http"``).
        token: the bearer token (None: no auth).
        max_body_bytes: the largest body accepted.
        route_of: a path -> its metrics label (``other`` when no route has it).
    """

    def __init__(
        self,
        app,
        metrics: ServerMetrics,
        *,
        token: str | None,
        max_body_bytes: int,
        route_of: Callable[[str], str],
    ):
        self.app, self.metrics, self.route_of = app, metrics, route_of
        self.expected = None if token is None else f"Bearer {token}".encode()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        refusal = self._refusal(scope["path"], headers)
        if refusal is None and scope["method"] in ("POST", "PUT", "PATCH"):
            body, refusal = await self._read(receive)
            if body is None:
                return  # the client left while sending: nobody to answer
            receive = _replay(body, receive)
        if refusal is not None:
            return await self._refuse(scope, refusal, receive, send)
        kept = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        scope = {**scope, "headers": [*kept, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)

    def _refusal(self, path: str, headers: dict) -> Exception | None:
        if self.expected is not None and path not in OPEN_PATHS:
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return UnauthenticatedError("authorization: missing or wrong bearer token")
        size = headers.get(b"content-length", b"")
        if size.isdigit() and int(size) > self.max_body_bytes:
            return self._too_large(size.decode())
        return None

    def _too_large(self, size: str) -> HttpError:
        return HttpError(413, f"body: {size} bytes, more than the limit {self.max_body_bytes}")

    async def _read(self, receive) -> tuple[bytes | None, Exception | None]:
        """The whole body (None if the client left first), or a 413."""
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None, None
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body_bytes:
                return b"", self._too_large(f"over {self.max_body_bytes}")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None

    async def _refuse(self, scope, exc: Exception, receive, send) -> None:
        response = error_response(exc)
        self.metrics.observe_request(
            self.route_of(scope["path"]), str(response.status_code), 0.0, front="http"
        )
        await response(scope, receive, send)


def _replay(body: bytes, receive):
    """A ``receive`` that hands ``body`` over once, then listens to the client."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed

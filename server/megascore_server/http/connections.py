"""The HTTP front's guards against slow and flooding clients, in uvicorn's h11 protocol.

uvicorn keeps a connection that never completes a request head for as long as the
client likes (its keep-alive timer stops at the first byte received) and accepts
connections as long as the process has descriptors. :func:`guarded_protocol` adds:

* **a header timeout**: a connection must deliver a whole request head within
  ``header_timeout_s`` of opening, or of the end of its previous response; else it is
  closed (an idle connection that never sends, slowloris headers trickled a byte at a
  time), at a time drawn from 1 to 1.25 times the timeout (:data:`TIMEOUT_SPREAD`). A
  request whose head has arrived is not timed here (its body is bounded by the body
  limit, its answer by ``X-Request-Timeout``);
* **a connection cap**: beyond ``max_connections`` open connections a new one is
  answered 503 with ``Retry-After`` in OpenAI's error shape and closed at once, so its
  descriptor is freed before it can send anything.
"""

from __future__ import annotations

import asyncio
import random

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from megascore.api.errors import UnavailableError
from megascore_server.http.errors import error_response

TIMEOUT_SPREAD = 0.25
"""A connection's header timeout is drawn from ``[1, 1 + this] * header_timeout_s``:
connections opened together (a flood, or a reconnecting client pool) are closed over a
stretch of time, not in one event-loop iteration, and their reopening is spread too."""


def _busy_answer(max_connections: int) -> bytes:
    """The raw 503 a connection over the cap gets."""
    response = error_response(
        UnavailableError(f"the HTTP front holds its limit of {max_connections} connections")
    )
    head = [b"HTTP/1.1 503 Service Unavailable", *(k + b": " + v for k, v in response.raw_headers)]
    return b"\r\n".join([*head, b"", response.body])  # its headers say connection: close


def guarded_protocol(*, max_connections: int, header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the cap and the header timeout (``uvicorn.Config(http=)``).

    Args:
        max_connections: the most connections open at once.
        header_timeout_s: seconds a connection has to send a whole request head.
    """
    busy = _busy_answer(max_connections)

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(busy)
                transport.close()
                return
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                spread = header_timeout_s * TIMEOUT_SPREAD * random.random()
                self._header_timer = self.loop.call_later(header_timeout_s + spread, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            """Closes the connection unless a request head arrived since :meth:`_arm`."""
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol

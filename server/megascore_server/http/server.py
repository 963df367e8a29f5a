"""Runs the HTTP front in rank 0's event loop, beside the gRPC server.

:class:`HttpFront` binds its socket when built (a port in use fails at start-up, as
gRPC's does), serves with uvicorn from :meth:`HttpFront.start` (its signal handlers
off: rank 0's own handlers drive the drain) and stops after the gRPC drain
(:meth:`megascore_server.lifecycle.ServerHandles.stop`): the gate has answered new
calls 503 (``Retry-After``, ``Connection: close``: a keep-alive connection is closed
after that answer, never under a later request) since the drain began and the calls in
flight have finished by then.
TLS and mutual TLS use the gRPC server's files; the connection cap and the header
timeout are in :mod:`megascore_server.http.connections`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

import uvicorn

from megascore_server.config import GrpcServerConfig
from megascore_server.connection_limits import connection_cap
from megascore_server.http.app import build_app
from megascore_server.http.bodies import BodyParser
from megascore_server.http.connections import guarded_protocol
from megascore_server.memory_trim import MemoryTrim
from megascore_server.metrics import ServerMetrics
from megascore_server.service import ScoringService

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers (rank 0 drains on its own signals)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn releases
        return None


LISTEN_BACKLOG = 1024
"""Connections the kernel queues for the HTTP front before it accepts them."""
ACCEPT_BUDGET = 32
"""Connections accepted in one event-loop iteration. asyncio accepts up to its server's
``backlog`` at once, each with its transport and protocol made in that iteration: 2,048
(uvicorn's default) reconnecting clients held both fronts ~0.1-0.2 s at a time."""


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"cannot bind the HTTP port {host}:{port}: {exc.strerror}") from exc
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


class HttpFront:
    """The HTTP front of one server: bound on construction, served from :meth:`start`.

    Args:
        service: the scoring service.
        config: host, ``http_port``, TLS files, message limit.
        metrics: the server's metrics.
        token: the bearer token (None: no auth).
        memory: trims what large bodies leave behind (shared with the gRPC front).
    """

    def __init__(
        self,
        service: ScoringService,
        config: GrpcServerConfig,
        metrics: ServerMetrics,
        token: str | None,
        memory: MemoryTrim,
    ):
        self._bodies = BodyParser(memory)
        app = build_app(
            service,
            metrics,
            token=token,
            max_body_bytes=config.max_message_bytes,
            bodies=self._bodies,
        )
        tls = {}
        if config.tls_enabled:
            tls = {"ssl_certfile": config.tls_cert, "ssl_keyfile": config.tls_key}
            if config.tls_client_ca:
                tls.update(ssl_ca_certs=config.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        self._server = _Server(
            uvicorn.Config(
                app,
                log_level="warning",
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=1,
                backlog=ACCEPT_BUDGET,
                http=guarded_protocol(
                    max_connections=connection_cap(config.max_connections),
                    header_timeout_s=config.header_timeout_s,
                ),
                **tls,
            )
        )
        self._sock = _bind(config.host, config.http_port)
        self.port = self._sock.getsockname()[1]
        self.scheme = "https" if config.tls_enabled else "http"
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Serves until :meth:`stop`."""
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._sock]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # raises why it could not start
        # asyncio's listen(backlog) made the kernel's queue ACCEPT_BUDGET long: back to
        # LISTEN_BACKLOG (the accept loop keeps its budget), so a burst is queued, not dropped.
        self._sock.listen(LISTEN_BACKLOG)
        logger.info("HTTP front on %s://%s", self.scheme, self._sock.getsockname()[:2])

    async def stop(self) -> None:
        """Closes the listener and the idle connections; waits for the server to end."""
        if self._task is None:
            self._sock.close()
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
        self._sock.close()
        self._bodies.close()

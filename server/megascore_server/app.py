"""Assembles the gRPC server of rank 0, with or without its engine yet.

:func:`build_server` wires the servicer, health, reflection, auth, TLS and
metrics together and binds the address; the engine is attached at once or
later (:meth:`ServerHandles.attach_engine`, after
:meth:`ServerHandles.load_engine`), so the server can answer health probes
(NOT_SERVING) while a large model loads. The lifecycle (start, attach, stop)
is :class:`megascore_server.lifecycle.ServerHandles`.
"""

from __future__ import annotations

import concurrent.futures
import logging

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from megascore.api.types import Engine
from megascore.v1 import scoring_pb2_grpc as pb_grpc
from megascore_server.auth import BearerTokenInterceptor, read_token
from megascore_server.config import GrpcServerConfig
from megascore_server.connection_limits import connection_cap
from megascore_server.gate import CallGate
from megascore_server.health import SCORER_SERVICE, ScorerHealth
from megascore_server.lifecycle import ServerHandles, resolve_limits
from megascore_server.memory_trim import MemoryTrim, limit_malloc_arenas
from megascore_server.metrics import ServerMetrics
from megascore_server.service import ScoringService
from megascore_server.servicer import ScorerServicer
from megascore_server.status import StatusInterceptor
from megascore_server.tls import server_credentials, warn_if_exposed
from megascore_server.tokenizer import ServerTokenizer

__all__ = ["ServerHandles", "build_server", "resolve_limits"]

logger = logging.getLogger(__name__)


def _bind_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def _grpc_server(
    config: GrpcServerConfig, metrics: ServerMetrics, token: str | None, memory: MemoryTrim
) -> grpc.aio.Server:
    """The gRPC server with its interceptors, message and connection limits (no service
    added)."""
    # First: it also answers (and counts) the calls the next ones refuse.
    interceptors = [StatusInterceptor(metrics, memory)]
    if token is not None:
        interceptors.append(BearerTokenInterceptor(token))
    return grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
            ("grpc.max_concurrent_streams", config.max_concurrent_streams),
            ("grpc.max_allowed_incoming_connections", connection_cap(config.max_connections)),
            ("grpc.server_handshake_timeout_ms", int(config.header_timeout_s * 1000)),
        ],
    )


def _bind(server: grpc.aio.Server, address: str, credentials) -> int:
    """Binds ``address`` (TLS with ``credentials``); returns the port.

    Raises:
        RuntimeError: the address cannot be bound.
    """
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot bind {address}: {exc}") from exc
    if port == 0:
        raise RuntimeError(f"cannot bind {address}")
    return port


def build_server(
    engine: Engine | None,
    server_config: GrpcServerConfig,
    *,
    pad_multiple: int = 1,
    tokenizer: ServerTokenizer | None = None,
) -> tuple[grpc.aio.Server, int, ServerHandles]:
    """Builds and binds (does not start) the gRPC server of rank 0, and the HTTP front
    when ``http_port`` is set (``handles.http``). Call it from a coroutine.

    Args:
        engine: a ready engine (``info``, ``score``, ``load_weights``, ``shutdown``),
            or None to attach one later (the Scorer RPCs answer UNAVAILABLE until then).
        server_config: address, limits, security and metrics settings.
        pad_multiple: the engine's per-sequence pad multiple (ignored without an engine).
        tokenizer: the server's tokenizer (text prompts, token strings), or None.

    Returns:
        ``(server, bound port, handles)``; ``await handles.start()`` starts serving.

    Raises:
        ValueError: inconsistent limits, unreadable TLS / token files.
        RuntimeError: the address cannot be bound.
    """
    config = server_config
    limit_malloc_arenas()  # before the server's threads start
    metrics = ServerMetrics()
    health_servicer = ScorerHealth()
    gate = CallGate(health_servicer)
    service = ScoringService(
        gate,
        max_tokens_per_batch=config.max_tokens_per_batch,
        max_message_bytes=config.max_message_bytes,
        tokenizer=tokenizer,
    )
    memory = MemoryTrim()  # both fronts' large requests, stalled streams
    servicer = ScorerServicer(
        service, max_stream_inflight=config.max_stream_inflight, memory=memory
    )
    token = read_token(config.auth_token_file) if config.auth_token_file else None
    credentials = server_credentials(config)  # unreadable files fail before anything starts
    server = _grpc_server(config, metrics, token, memory)
    # The engine thread: builds the engine (load_engine), then runs every step.
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megascore-engine")
    handles = ServerHandles(
        server=server,
        config=config,
        health=health_servicer,
        gate=gate,
        service=service,
        metrics=metrics,
        executor=executor,
    )
    if engine is not None:
        handles.wire_engine(engine, pad_multiple)  # before binding: bad limits fail early
    pb_grpc.add_ScorerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SCORER_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = _bind(server, _bind_address(config.host, config.port), credentials)
    if config.http_port:
        from megascore_server.http.server import HttpFront  # the ASGI stack, only when on

        handles.http = HttpFront(service, config, metrics, token, memory)
    warn_if_exposed(config)
    if config.metrics_port:
        handles.metrics_port = metrics.start_http(config.host, config.metrics_port)
    logger.info(
        "megascore.v1.Scorer bound on %s (%s, auth %s)%s%s",
        _bind_address(config.host, port),
        "TLS" if credentials is not None else "plaintext",
        "on" if config.auth_token_file else "off",
        "" if handles.http is None else f"; HTTP front on port {handles.http.port}",
        "" if engine is not None else "; no engine yet (UNAVAILABLE until attached)",
    )
    return server, port, handles

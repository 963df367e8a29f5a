"""Assembles the gRPC server of rank 0 around an engine.

:func:`build_server` wires the batcher, servicer, health, reflection, auth,
TLS and metrics together; :class:`ServerHandles` starts it (health SERVING)
and stops it gracefully: health NOT_SERVING -> ``server.stop(grace)`` ->
batcher closed -> ``engine.shutdown()`` on the engine thread (after the last
step).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from megascore.types import Engine
from megascore.v1 import scoring_pb2_grpc as pb_grpc
from megascore_server.auth import BearerTokenInterceptor, read_token
from megascore_server.batcher import DynamicBatcher
from megascore_server.config import ServerConfig
from megascore_server.health import SCORER_SERVICE, ScorerHealth
from megascore_server.metrics import ServerMetrics
from megascore_server.microbatch import padded_lengths
from megascore_server.servicer import ScorerServicer
from megascore_server.tls import server_credentials, warn_if_exposed
from megascore_server.validation import RequestLimits

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class ServerHandles:
    """The parts of a built server, and its lifecycle."""

    server: grpc.aio.Server
    config: ServerConfig
    engine: Engine
    batcher: DynamicBatcher
    health: ScorerHealth
    servicer: ScorerServicer
    metrics: ServerMetrics
    executor: concurrent.futures.ThreadPoolExecutor
    limits: RequestLimits
    metrics_port: int | None = None
    fatal: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    fatal_error: BaseException | None = None
    _stopped: bool = False

    async def start(self) -> None:
        """Starts serving and marks health SERVING (the engine is ready)."""
        await self.server.start()
        await self.health.set_serving()

    def on_fatal(self, exc: BaseException) -> None:
        """Batcher callback: the engine lost a rank. Health goes NOT_SERVING at once."""
        self.fatal_error = exc
        self.health.serving = False
        asyncio.get_running_loop().create_task(self.health.shut_down(f"engine lost: {exc}"))
        self.fatal.set()

    async def stop(self, grace: float | None = None, *, engine_timeout_s: float = 60.0) -> bool:
        """Graceful stop: health off, finish in-flight RPCs within ``grace``, shut the engine.

        Args:
            grace: seconds given to in-flight RPCs (None = ``config.grace_s``).
            engine_timeout_s: longest wait for ``engine.shutdown()``.

        Returns:
            True when ``engine.shutdown()`` returned in time without raising.
        """
        if self._stopped:
            return True
        self._stopped = True
        grace = self.config.grace_s if grace is None else grace
        await self.health.shut_down("draining")
        logger.info("stopping: %.1f s grace for in-flight requests", grace)
        await self.server.stop(grace)
        await self.batcher.close()
        self.metrics.stop_http()
        loop = asyncio.get_running_loop()
        ok = True
        try:
            await asyncio.wait_for(
                loop.run_in_executor(self.executor, self.engine.shutdown), engine_timeout_s
            )
            logger.info("engine shut down")
        except TimeoutError:
            logger.error("engine.shutdown() did not return within %.0f s", engine_timeout_s)
            ok = False
        except Exception:
            logger.exception("engine.shutdown() failed")
            ok = False
        self.executor.shutdown(wait=False, cancel_futures=True)
        return ok


def resolve_limits(info, config: ServerConfig, pad_multiple: int) -> RequestLimits:
    """The request limits: the model's, tightened by the config and the step budget.

    Raises:
        ValueError: ``max_sequence_length`` above the model's or not fitting one step.
    """
    model_max = int(info.max_sequence_length)
    max_len = model_max
    if config.max_sequence_length is not None:
        if config.max_sequence_length > model_max:
            raise ValueError(
                f"max_sequence_length {config.max_sequence_length} exceeds the model's {model_max}"
            )
        max_len = config.max_sequence_length
    fits = config.max_tokens_per_batch // pad_multiple * pad_multiple
    if int(padded_lengths(np.array([max_len]), pad_multiple)[0]) > config.max_tokens_per_batch:
        if config.max_sequence_length is not None:
            raise ValueError(
                f"max_sequence_length {max_len} does not fit max_tokens_per_batch "
                f"{config.max_tokens_per_batch} (pad multiple {pad_multiple})"
            )
        logger.warning(
            "model max_sequence_length %d exceeds max_tokens_per_batch %d: accepting "
            "sequences up to %d tokens",
            max_len,
            config.max_tokens_per_batch,
            fits,
        )
        max_len = fits
    return RequestLimits(
        vocab_size=int(info.vocab_size),
        max_sequence_length=max_len,
        max_request_tokens=config.max_request_tokens,
        max_top_k=int(info.max_top_k),
        loss_names=frozenset(info.loss_names),
    )


def _bind_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def build_server(
    engine: Engine, server_config: ServerConfig, *, pad_multiple: int = 1
) -> tuple[grpc.aio.Server, int, ServerHandles]:
    """Builds (does not start) the gRPC server of rank 0. Call it from a coroutine.

    Args:
        engine: a ready engine (``info``, ``score``, ``load_weights``, ``shutdown``).
        server_config: address, limits, security and metrics settings.
        pad_multiple: the engine's per-sequence pad multiple (step budget accounting).

    Returns:
        ``(server, bound port, handles)``; ``await handles.start()`` starts serving.

    Raises:
        ValueError: inconsistent limits, unreadable TLS / token files.
        RuntimeError: the address cannot be bound.
    """
    config = server_config
    info = engine.info()
    limits = resolve_limits(info, config, pad_multiple)
    metrics = ServerMetrics()
    health_servicer = ScorerHealth()
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megascore-engine")
    batcher = DynamicBatcher(
        engine,
        executor,
        max_tokens_per_batch=config.max_tokens_per_batch,
        max_batch_wait_ms=config.max_batch_wait_ms,
        max_queue=config.max_queue,
        max_queue_tokens=config.max_queue_tokens,
        pad_multiple=pad_multiple,
        weights_version=info.weights_version,
        metrics=metrics,
    )
    servicer = ScorerServicer(
        batcher,
        health_servicer,
        limits,
        info,
        max_tokens_per_batch=config.max_tokens_per_batch,
        max_stream_inflight=config.max_stream_inflight,
        metrics=metrics,
    )
    interceptors = []
    if config.auth_token_file:
        token = read_token(config.auth_token_file)

        def on_reject(method: str) -> None:
            rpc = method.rsplit("/", 1)[-1]
            metrics.observe_request(rpc, grpc.StatusCode.UNAUTHENTICATED.name, 0.0)

        interceptors.append(BearerTokenInterceptor(token, on_reject=on_reject))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_ScorerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SCORER_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = _bind_address(config.host, config.port)
    credentials = server_credentials(config)
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot bind {address}: {exc}") from exc
    if port == 0:
        raise RuntimeError(f"cannot bind {address}")
    warn_if_exposed(config)
    handles = ServerHandles(
        server=server,
        config=config,
        engine=engine,
        batcher=batcher,
        health=health_servicer,
        servicer=servicer,
        metrics=metrics,
        executor=executor,
        limits=limits,
    )
    batcher.on_fatal = handles.on_fatal
    if config.metrics_port:
        handles.metrics_port = metrics.start_http(config.host, config.metrics_port)
    logger.info(
        "megascore.v1.Scorer bound on %s (%s, auth %s), model %s",
        _bind_address(config.host, port),
        "TLS" if credentials is not None else "plaintext",
        "on" if interceptors else "off",
        info.name,
    )
    return server, port, handles

"""Lifecycle of rank 0's gRPC server: loading -> serving -> draining.

:class:`ServerHandles` holds the parts :func:`megascore_server.app.build_server`
assembled. The server may start before the engine exists:

1. ``await handles.start()``: the server answers; health NOT_SERVING and the
   Scorer RPCs fail with UNAVAILABLE ("model loading") while no engine is attached.
2. ``engine = await handles.load_engine(factory)``: the factory runs on the
   engine thread (the single executor thread that later runs every step, so a
   collective engine keeps all its collectives on one thread).
3. ``await handles.attach_engine(engine, pad_multiple=...)``: request limits and
   batcher are wired in; health SERVING.
4. ``await handles.stop()``: the drain.

   a. Health NOT_SERVING for good; new Scorer calls fail fast with UNAVAILABLE
      ("server shutting down") while the gRPC server keeps running.
   b. The calls in progress finish (at most ``grace`` s in all).
   c. For :data:`PARK_S` s new calls are parked (not answered; also when ``grace``
      is 0, as after a lost rank, so a stop may take ``grace + PARK_S``), then
      ``server.stop()`` begins (grpc core stops accepting calls and sends GOAWAY),
      and only then do the parked calls get UNAVAILABLE.
   d. Batcher closed -> ``engine.shutdown()`` on the engine thread, queued after
      the last step (or after a load still in progress, which cannot be
      interrupted).

   Why c: a call that reaches grpc core after its shutdown began, before the
   client has read the GOAWAY, is cancelled by grpc core itself (CANCELLED, no
   handler runs; grpc-python has no way to answer it otherwise). A client
   retrying on UNAVAILABLE would send its next call right into that instant;
   a parked client sends nothing, and its UNAVAILABLE comes after the GOAWAY on
   the same connection, so its retry takes a new connection (another replica,
   or connection refused: UNAVAILABLE again).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
import numpy as np

from megascore.api.errors import UnavailableError
from megascore.api.layout import padded_lengths
from megascore.api.limits import Limits
from megascore.api.types import Engine, ModelInfo
from megascore_server.batcher import DynamicBatcher
from megascore_server.config import GrpcServerConfig
from megascore_server.gate import CallGate
from megascore_server.health import ScorerHealth
from megascore_server.metrics import ServerMetrics
from megascore_server.service import ScoringService
from megascore_server.shared_units import Sharing

if TYPE_CHECKING:
    from megascore_server.http.server import HttpFront

logger = logging.getLogger(__name__)

PARK_S = 0.2
"""Drain: how long new calls are parked before grpc core shuts down (see module doc)."""


def resolve_limits(info: ModelInfo, config: GrpcServerConfig, pad_multiple: int) -> Limits:
    """The request limits: the model's (``info.limits``), tightened by the config and the
    step budget, with the per-request token limit.

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
    return dataclasses.replace(
        info.limits, max_sequence_length=max_len, max_request_tokens=config.max_request_tokens
    )


@dataclasses.dataclass(eq=False)
class ServerHandles:
    """The parts of a built server, and its lifecycle (see the module docstring).

    ``engine``, ``batcher`` and ``limits`` are None until an engine is attached.
    """

    server: grpc.aio.Server
    config: GrpcServerConfig
    health: ScorerHealth
    gate: CallGate
    service: ScoringService
    metrics: ServerMetrics
    executor: concurrent.futures.ThreadPoolExecutor
    engine: Engine | None = None
    batcher: DynamicBatcher | None = None
    limits: Limits | None = None
    metrics_port: int | None = None
    http: HttpFront | None = None
    """The HTTP front (``http_port`` set), started and stopped with the gRPC server."""
    fatal: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    fatal_error: BaseException | None = None
    _started: bool = False
    _load: concurrent.futures.Future | None = None
    _stopped: bool = False

    async def start(self) -> None:
        """Starts answering; health goes SERVING now if an engine is attached, else later."""
        await self.server.start()
        if self.http is not None:
            await self.http.start()
        self._started = True
        await self.gate.open()

    async def load_engine(self, factory: Callable[[], Engine]) -> Engine:
        """Builds the engine on the engine thread (the thread that runs every later step).

        Args:
            factory: builds the engine; may block for minutes (collective model load).

        Returns:
            The engine, not yet attached (see :meth:`attach_engine`).

        Raises:
            UnavailableError: the server was stopped before the load began.
            Exception: whatever ``factory`` raised.
        """
        if self._stopped:
            raise UnavailableError("server stopped before the model was loaded")

        def build() -> Engine:
            # Set on the engine thread: a stop() during the load queues engine.shutdown()
            # behind this job, and that job reads it there.
            self.engine = factory()
            return self.engine

        start = time.monotonic()
        logger.info("loading the model on the engine thread (health NOT_SERVING meanwhile)")
        self._load = self.executor.submit(build)
        engine = await asyncio.wrap_future(self._load)
        logger.info("model built on every rank in %.1f s", time.monotonic() - start)
        return engine

    def wire_engine(self, engine: Engine, pad_multiple: int = 1) -> None:
        """Wires ``engine`` in (limits, batcher, servicer) without touching health; the
        batcher plans shared prompts together when the engine exposes the prefixes its
        steps share (:meth:`Sharing.of`)."""
        if self.batcher is not None:
            raise RuntimeError("an engine is already attached")
        info = engine.info()
        limits = resolve_limits(info, self.config, pad_multiple)
        batcher = DynamicBatcher(
            engine,
            self.executor,
            max_tokens_per_batch=self.config.max_tokens_per_batch,
            max_batch_wait_ms=self.config.max_batch_wait_ms,
            max_queue=self.config.max_queue,
            max_queue_tokens=self.config.max_queue_tokens,
            pad_multiple=pad_multiple,
            sharing=Sharing.of(engine),
            metrics=self.metrics,
            on_fatal=self.on_fatal,
        )
        self.engine, self.batcher, self.limits = engine, batcher, limits
        self.service.attach(batcher, limits, info)
        self.gate.engine_attached()
        self.metrics.set_model(info.name, info.parallel)
        stats = getattr(engine, "prefix_cache_stats", None)
        if stats is not None and stats() is not None:
            self.metrics.set_prefix_cache(stats)
        logger.info(
            "model %s attached (weights %s, pad multiple %d, max_sequence_length %d)",
            info.name,
            info.weights_version,
            pad_multiple,
            limits.max_sequence_length,
        )

    async def attach_engine(self, engine: Engine, *, pad_multiple: int = 1) -> None:
        """Wires a ready engine in; health SERVING if the server is started.

        Args:
            engine: built on every rank (``info``, ``score``, ``load_weights``, ``shutdown``).
            pad_multiple: the engine's per-sequence pad multiple (step budget accounting).

        Raises:
            UnavailableError: the server is stopping (its ``stop()`` shuts the engine down).
            ValueError: the config's limits do not fit the model.
            RuntimeError: an engine is already attached.
        """
        if self._stopped:
            raise UnavailableError("server stopped while the model was loading")
        self.wire_engine(engine, pad_multiple)
        # Start-up's objects (torch, Megatron, the model) leave the cyclic collector: a
        # full collection (megascore_server.memory_trim) then takes ms, not ~0.5 s.
        gc.freeze()
        if self._started:
            await self.gate.open()

    def on_fatal(self, exc: BaseException) -> None:
        """Batcher callback: the engine lost a rank. Health goes NOT_SERVING at once."""
        self.fatal_error = exc
        self.gate.lose(f"engine lost: {exc}")
        self.fatal.set()

    def _shutdown_engine(self) -> None:  # engine thread, after the last step or load
        if self.engine is None:
            logger.info("no engine was built: nothing to shut down")
            return
        self.engine.shutdown()
        logger.info("engine shut down")

    async def stop(self, grace: float | None = None, *, engine_timeout_s: float = 60.0) -> bool:
        """Graceful stop: health off, finish in-flight RPCs within ``grace``, shut the engine.

        Args:
            grace: seconds given to in-flight RPCs (None = ``config.grace_s``).
            engine_timeout_s: longest wait for ``engine.shutdown()`` (queued behind a
                step or a load still running on the engine thread).

        Returns:
            True when ``engine.shutdown()`` returned in time without raising (or no
            engine was ever built).
        """
        if self._stopped:
            return True
        self._stopped = True
        grace = self.config.grace_s if grace is None else grace
        deadline = time.monotonic() + grace
        loading = self._load is not None and not self._load.done()
        await self.gate.drain("stopping while loading" if loading else "draining")
        logger.info("stopping: %.1f s grace for in-flight requests", grace)
        if not await self.gate.wait_idle(grace):
            logger.warning(
                "%d call(s) still running after %.1f s grace: cancelling them",
                self.gate.active_calls,
                grace,
            )
        self.gate.park_new_calls()  # also with no grace (a lost rank): see module doc, c
        await asyncio.sleep(PARK_S)
        stopping = asyncio.ensure_future(self.server.stop(max(deadline - time.monotonic(), 0.0)))
        await asyncio.sleep(0)  # stop() has run up to its first wait: core shut down, GOAWAY sent
        self.gate.release_parked()
        await stopping
        if self.http is not None:
            await self.http.stop()
        if self.batcher is not None:
            await self.batcher.close()
        self.metrics.stop_http()
        done = asyncio.wrap_future(self.executor.submit(self._shutdown_engine))
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved when late
        self.executor.shutdown(wait=False)  # the thread leaves after the queued shutdown
        try:
            await asyncio.wait_for(asyncio.shield(done), engine_timeout_s)
        except TimeoutError:
            if loading:
                logger.error("the model load cannot be interrupted: shutdown queued after it")
            else:
                logger.error("engine.shutdown() did not return within %.0f s", engine_timeout_s)
            return False
        except Exception:
            logger.exception("engine.shutdown() failed")
            return False
        return True

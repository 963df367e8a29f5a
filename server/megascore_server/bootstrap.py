"""Rank bootstrap: build the engine on every rank, serve on rank 0, work on the others.

The only place of the server that touches the torch-based engine, and only
lazily (:func:`_create_engine`). Lifecycle of rank 0: engine built on every
rank -> gRPC server started, health SERVING -> SIGTERM / SIGINT: health
NOT_SERVING, ``server.stop(grace)`` (in-flight requests finish), then
``engine.shutdown()`` (broadcasts SHUTDOWN, destroys the process group) ->
exit 0. A lost rank (``WorkerLostError``) -> health NOT_SERVING, in-flight
requests fail with UNAVAILABLE, exit 1 so the launcher tears the replica down.

Worker ranks ignore SIGTERM / SIGINT: they leave ``engine.worker_loop()``
when rank 0 broadcasts SHUTDOWN (or fail when it is gone, after the
collective timeout), so a signal sent to the whole process group drains
cleanly through rank 0.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import os
import signal
import socket
import threading

from megascore.config import EngineConfig
from megascore.errors import WorkerLostError
from megascore_server.app import build_server
from megascore_server.config import ServeConfig

logger = logging.getLogger(__name__)

ENGINE_FACTORY_ENV = "MEGASCORE_ENGINE_FACTORY"
"""``module:callable`` building the engine from an EngineConfig instead of DistributedEngine."""


def _create_engine(engine_config: EngineConfig):
    """Builds the real engine (collective: every rank of the replica calls it)."""
    from megascore.engine.runtime import DistributedEngine

    return DistributedEngine.create(engine_config)


def create_engine(engine_config: EngineConfig):
    """Builds this rank's engine: ``$MEGASCORE_ENGINE_FACTORY`` if set, else the real one."""
    spec = os.environ.get(ENGINE_FACTORY_ENV)
    if not spec:
        return _create_engine(engine_config)
    module, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"{ENGINE_FACTORY_ENV} must be 'module:callable', got {spec!r}")
    factory = getattr(importlib.import_module(module), attr)
    logger.info("engine from %s", spec)
    return factory(engine_config)


def pad_multiple(engine, engine_config: EngineConfig) -> int:
    """Per-sequence pad multiple of the engine (the batcher budgets padded tokens).

    Uses ``engine.pad_multiple`` when the engine exposes it, else the engine's
    layout rule (``megascore.engine.step.step_pad_multiple``, restated here to stay
    torch-free): ``pad_to_multiple_of``, lcm ``2 * cp`` with CP, lcm ``tp * cp`` with
    sequence parallelism.
    """
    exposed = getattr(engine, "pad_multiple", None)
    if isinstance(exposed, int) and exposed >= 1:
        return exposed
    multiple = engine_config.pad_to_multiple_of
    cp = engine_config.context_parallel_size
    if cp > 1:
        multiple = math.lcm(multiple, 2 * cp)
    if engine_config.sequence_parallel:
        multiple = math.lcm(multiple, engine_config.tensor_model_parallel_size * cp)
    return multiple


def ensure_dist_env() -> None:
    """A single process (no launcher) still gets the ``env://`` rendezvous variables."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        os.environ.setdefault(key, value)


async def serve_async(engine, config: ServeConfig) -> int:
    """Serves on rank 0 until SIGTERM / SIGINT (exit 0) or a lost rank (exit 1)."""
    server_config = config.server
    server, port, handles = build_server(
        engine, server_config, pad_multiple=pad_multiple(engine, config.engine)
    )
    await handles.start()
    logger.info("megascore serving on %s:%d", server_config.host, port)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        if not stop.is_set():
            logger.info(
                "%s: draining (grace %.1f s)", signal.Signals(signum).name, server_config.grace_s
            )
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(handles.fatal.wait())]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    if handles.fatal.is_set():
        logger.critical("lost a rank (%s): stopping with exit code 1", handles.fatal_error)
        await handles.stop(grace=0.0, engine_timeout_s=min(10.0, server_config.grace_s + 1))
        return 1
    ok = await handles.stop(engine_timeout_s=config.engine.collective_timeout_s + 10)
    return 0 if ok else 1


def run_rank(config: ServeConfig) -> int:
    """Runs this process's rank (RANK from the environment); returns its exit code."""
    ensure_dist_env()
    rank = int(os.environ["RANK"])
    if rank != 0:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, _worker_signal)
    try:
        engine = create_engine(config.engine)
    except Exception:
        logger.exception("rank %d: building the engine failed", rank)
        return 1
    if rank == 0:
        code = asyncio.run(serve_async(engine, config))
        _exit_if_engine_stuck(code)
        return code
    try:
        engine.worker_loop()
    except WorkerLostError as exc:
        logger.critical("rank %d: %s", rank, exc.reason)
        return 1
    except Exception:
        logger.exception("rank %d: worker loop failed", rank)
        return 1
    logger.info("rank %d: SHUTDOWN received, exiting", rank)
    return 0


def _exit_if_engine_stuck(code: int) -> None:
    """A step or shutdown hung on a dead rank would block interpreter exit: leave now."""
    engine_threads = [t for t in threading.enumerate() if t.name.startswith("megascore-engine")]
    for thread in engine_threads:
        thread.join(2.0)  # an idle executor thread exits right after shutdown()
    if any(t.is_alive() for t in engine_threads):
        logger.error("engine thread still busy; exiting with code %d without waiting", code or 1)
        logging.shutdown()
        os._exit(code or 1)


def _worker_signal(signum: int, frame) -> None:
    logger.info(
        "rank %s: %s received; waiting for SHUTDOWN from rank 0",
        os.environ.get("RANK"),
        signal.Signals(signum).name,
    )

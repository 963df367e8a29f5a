"""Rank bootstrap: build the engine on every rank, serve on rank 0, work on the others.

The only place of the server that touches the torch-based engine, and only
lazily (:func:`_create_engine`). Lifecycle of rank 0:

* gRPC server bound and started first: health NOT_SERVING, Scorer calls
  UNAVAILABLE ("model loading") while every rank builds the engine. Rank 0
  builds it on the engine thread, the single executor thread that later runs
  every step (its collectives, and its CUDA current device, stay on one thread).
* ``create_engine`` returned (the engine barriers after every rank built it):
  health SERVING.
* SIGTERM / SIGINT: health NOT_SERVING, new calls UNAVAILABLE ("server shutting
  down"), in-flight requests finish (within ``grace``), ``server.stop()``
  (:meth:`ServerHandles.stop`), then ``engine.shutdown()`` (broadcasts SHUTDOWN,
  destroys the process group) -> exit 0.
* A lost rank (``WorkerLostError``) -> health NOT_SERVING, in-flight requests
  fail with UNAVAILABLE, exit 1 so the launcher tears the replica down.
* Building the engine failed -> reason logged, health never SERVING, server
  stopped, exit 1.
* SIGTERM / SIGINT while loading: a collective model load cannot be interrupted,
  so the server stops and the process exits 1 at once without waiting for it
  (the launcher / torchrun then stops the other ranks, still in the model build).

Worker ranks ignore SIGTERM / SIGINT: they leave ``engine.worker_loop()``
when rank 0 broadcasts SHUTDOWN (or fail when it is gone, after the
collective timeout), so a signal sent to the whole process group drains
cleanly through rank 0.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import threading

from megascore.api.errors import LOAD_FAILURES, WorkerLostError
from megascore.config import EngineConfig
from megascore_server import startup_logs
from megascore_server.app import ServerHandles, build_server
from megascore_server.config import ReplicaConfig
from megascore_server.tokenizer import ServerTokenizer, default_tokenizer_dir

logger = logging.getLogger(__name__)

ENGINE_FACTORY_ENV = "MEGASCORE_ENGINE_FACTORY"
"""``module:callable`` building the engine from an EngineConfig instead of DistributedEngine."""
EXIT_DIR_ENV = "MEGASCORE_EXIT_DIR"
"""A directory where each rank records its exit code (read by ``main.torchrun``)."""


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
    """Per-sequence pad multiple of the engine (the batcher budgets padded rows).

    Uses ``engine.pad_multiple`` when the engine exposes it (``DistributedEngine``
    does: it knows whether the served model turned sequence parallelism on), else
    :meth:`EngineConfig.pad_multiple` (the same torch-free rule the engine uses).
    """
    exposed = getattr(engine, "pad_multiple", None)
    if isinstance(exposed, int) and exposed >= 1:
        return exposed
    return engine_config.pad_multiple()


def ensure_dist_env() -> None:
    """A single process (no launcher) still gets the ``env://`` rendezvous variables.

    ``MASTER_PORT=0`` lets the (world-size 1) store bind a free port itself: a port
    picked here would only be bound after the imports, and could be taken by then.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0",
    }.items():
        os.environ.setdefault(key, value)


async def serve_async(config: ReplicaConfig) -> int:
    """Rank 0: binds and starts the server, loads the engine on the engine thread, serves.

    Health answers NOT_SERVING (Scorer calls UNAVAILABLE, "model loading") while
    every rank builds the model; SERVING once ``create_engine`` returned (the
    engine barriers after every rank has built it).

    Returns:
        The exit code: 0 after a SIGTERM / SIGINT drain; 1 when a rank was lost,
        building the engine failed, or a signal came while loading; 2 when the
        server cannot be set up (TLS / token files, limits not fitting the model).
    """
    server_config = config.server
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
    try:
        tokenizer = load_tokenizer(config)
        _, port, handles = build_server(None, server_config, tokenizer=tokenizer)
    except (ValueError, OSError) as exc:
        logger.error("cannot set up the gRPC server: %s", exc)
        return 2
    except RuntimeError as exc:
        logger.error("cannot start the gRPC server: %s", exc)
        return 1
    await handles.start()
    logger.info("megascore listening on %s:%d, NOT_SERVING while loading", server_config.host, port)
    code = await _load(handles, config, stop)
    startup_logs.summarise()
    if code is not None:
        return code
    logger.info("megascore serving on %s:%d", server_config.host, port)
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


def load_tokenizer(config: ReplicaConfig) -> ServerTokenizer | None:
    """The server's tokenizer: ``--tokenizer DIR``, else an ``hf:DIR`` model's own.

    Raises:
        ValueError: the directory holds no tokenizer that loads.
    """
    path = config.server.tokenizer or default_tokenizer_dir(config.engine.model)
    return None if path is None else ServerTokenizer(path)


async def _load(handles: ServerHandles, config: ReplicaConfig, stop: asyncio.Event) -> int | None:
    """Builds the engine on the engine thread and attaches it; an exit code when it failed.

    A signal while loading cannot interrupt the (collective) load: the server stops,
    and the caller exits 1 without waiting for it (the launcher / torchrun then stops
    the other ranks, which are still inside the model build).
    """
    load = asyncio.ensure_future(handles.load_engine(lambda: create_engine(config.engine)))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([load, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not load.done():
        logger.warning("signal while the model is loading: stopping without serving (exit 1)")
        await handles.stop(grace=0.0, engine_timeout_s=0.0)
        load.cancel()
        return 1
    if load.exception() is not None:
        exc = load.exception()
        expected = isinstance(exc, (*LOAD_FAILURES, WorkerLostError))  # the reason says it all
        logger.error("building the engine failed: %s", exc, exc_info=None if expected else exc)
        await handles.stop(grace=0.0, engine_timeout_s=10.0)
        return 1
    if stop.is_set():
        return None  # loaded just as the signal came: the caller drains (engine shutdown)
    engine = load.result()
    try:
        await handles.attach_engine(engine, pad_multiple=pad_multiple(engine, config.engine))
    except Exception as exc:  # ValueError: the config's limits do not fit the model
        logger.error("cannot serve the model: %s", exc, exc_info=not isinstance(exc, ValueError))
        await handles.stop(grace=0.0, engine_timeout_s=config.engine.collective_timeout_s + 10)
        return 2 if isinstance(exc, ValueError) else 1
    return None


def run_rank(config: ReplicaConfig) -> int:
    """Runs this process's rank (RANK from the environment); returns its exit code, also
    written to ``$MEGASCORE_EXIT_DIR/rank-<RANK>`` when that is set (read by
    :func:`megascore_server.main.torchrun`)."""
    code = _run_rank(config)
    exit_dir = os.environ.get(EXIT_DIR_ENV)
    if exit_dir:
        with open(os.path.join(exit_dir, f"rank-{os.environ['RANK']}"), "w") as f:
            f.write(str(code))
    return code


def _run_rank(config: ReplicaConfig) -> int:
    ensure_dist_env()
    rank = int(os.environ["RANK"])
    if rank != 0:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, _worker_signal)
    if rank == 0:
        code = asyncio.run(serve_async(config))
        _exit_if_engine_stuck(code)
        return code
    try:
        engine = create_engine(config.engine)
    except (*LOAD_FAILURES, WorkerLostError) as exc:  # the reason says it all
        logger.error("rank %d: building the engine failed: %s", rank, exc)
        return 1
    except Exception:
        logger.exception("rank %d: building the engine failed", rank)
        return 1
    finally:
        startup_logs.summarise()
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
    """A step or shutdown hung on a dead rank, or a model load still running, would block
    interpreter exit: leave now."""
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

"""Dynamic batcher of rank 0: merges concurrent requests into engine steps.

The asyncio side only queues; one executor thread runs the engine, one step (or one
weight load) at a time, so the collectives of the ranks never interleave. Scheduling:

* Requests wait in a FIFO queue bounded by ``max_queue`` requests and ``max_queue_tokens``
  tokens; beyond it :class:`ResourceExhaustedError`.
* A step is launched when its token budget can be filled, when the oldest waiting
  request has waited ``max_batch_wait_ms``, or at once when nothing else can join it.
  Planning units (a sequence, or a request's sequences that share a prompt:
  :mod:`megascore_server.shared_units`) are chosen first-fit decreasing by rows
  (:func:`~megascore_server.batch_assembly.fill_step`); a request larger than the budget
  is spread over several steps and reassembled in its own order.
* Requests with different options share a step: per-sequence temperature, the largest
  top_k (each request its k columns), the union of losses, logprobs if any wants them.
* A request that replays a MoE routing shares steps only with other such requests
  (Megatron replays the routing of a whole forward); a request asking for the
  routing shares steps with any other.
* A request asking for MoE or MTP metrics never shares a step: its metrics are
  those of forwards over its own sequences only. Over several steps they are formed
  once from the steps' added sums (:class:`~megascore_server.pending.PendingRequest`).
* A request pinned to a weights version (``options.weights_version``) is checked
  against its weight set's served version when a step that would take it starts: on
  another it fails at once with FAILED_PRECONDITION (a swap queued before it has run by
  then, so a pin on the version being committed is served). A swap is a barrier.
* A step holds one weight set's requests (``PendingRequest.group``), those of the LoRA
  adapters over it included (``pending.step_pieces``).
* Cancelled or expired requests are dropped; a step holding them runs on, unanswered.
* :meth:`~DynamicBatcher.swap_weights` (a weight load, a weight push's commit) is a
  barrier: requests accepted before it finish on the old weights, later ones wait and
  run on the new ones.
  :meth:`~DynamicBatcher.run_on_engine` slips other engine work (a push's
  staging) between two steps without waiting for the queue.
* :class:`WorkerLostError` from the engine is fatal: every pending and later
  request fails with UNAVAILABLE and ``on_fatal`` is called.
* :class:`InvalidRequestError` from a step (the engine's ``ScoreBatch.check``
  refused it) is one request's data: each request of the step is checked on
  its own (``engine.check``), those that fail get their own error (naming their
  own sequence) and the others are scored again without them, in the same step
  slot. Any other exception fails only the requests of that step.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from collections.abc import Callable

import numpy as np

from megascore.api.errors import (
    InvalidRequestError,
    ResourceExhaustedError,
    UnavailableError,
    WorkerLostError,
    WrongVersionError,
)
from megascore.api.layout import padded_lengths
from megascore.api.limits import check_pinned_version
from megascore.api.types import Engine, ModelInfo, ScoreBatch, ScoreOutput
from megascore_server.batch_assembly import fill_step, merge_batches
from megascore_server.metrics import ServerMetrics
from megascore_server.pending import Barrier, PendingRequest, TimedOutput, step_pieces
from megascore_server.shared_units import Sharing

logger = logging.getLogger(__name__)

_WINDOW_BUDGETS = 4  # requests looked at for one step: about this many budgets of tokens


class DynamicBatcher:
    """Queues validated requests and runs them through the engine in merged steps.

    Args:
        engine: the engine (``score`` and ``load_weights`` run on ``executor``).
        executor: a single-thread executor owned by the caller.
        max_tokens_per_batch: budget of a step: its padded rows.
        max_batch_wait_ms: longest wait before launching a step that is not full.
        max_queue: most waiting requests.
        max_queue_tokens: most waiting tokens (0 = no token bound).
        pad_multiple: the engine's per-sequence pad multiple (for the budget).
        sharing: what the engine's steps share, for the planning units
            (:mod:`megascore_server.shared_units`).
        metrics: optional Prometheus metrics.
        on_fatal: called once with the error that made the engine unusable (a
            :class:`WorkerLostError` from the engine, or a scheduler failure).
    """

    def __init__(
        self,
        engine: Engine,
        executor: concurrent.futures.Executor,
        *,
        max_tokens_per_batch: int,
        max_batch_wait_ms: float,
        max_queue: int,
        max_queue_tokens: int = 0,
        pad_multiple: int = 1,
        sharing: Sharing = Sharing(),
        metrics: ServerMetrics | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ):
        self._engine = engine
        self._executor = executor
        self.budget = max_tokens_per_batch
        self._max_wait_s = max_batch_wait_ms / 1000.0
        self._max_queue = max_queue
        self._max_queue_tokens = max_queue_tokens
        self._pad_multiple = pad_multiple
        self._sharing = sharing
        self._metrics = metrics
        self.on_fatal = on_fatal
        self._queue: collections.deque[PendingRequest | Barrier] = collections.deque()
        self._queued_requests = 0
        self._queued_tokens = 0
        self._running: list[PendingRequest] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closed: BaseException | None = None
        self.steps_run = 0

    # ---------------------------------------------------------------- public API

    async def submit(
        self, request_id: str, batch: ScoreBatch, *, arrival: float, deadline: float | None = None
    ) -> TimedOutput:
        """Queues one validated request and waits for its result.

        Args:
            request_id: for logs.
            batch: the request's sequences and options.
            arrival: ``time.monotonic()`` when the request arrived.
            deadline: ``time.monotonic()`` after which the request is dropped.

        Raises:
            ResourceExhaustedError: the queue is full.
            UnavailableError: shutting down or the engine was lost.
        """
        self._check_open()
        tokens = batch.num_tokens
        if self._queued_requests >= self._max_queue:
            raise ResourceExhaustedError(
                f"queue full: {self._queued_requests} requests waiting (max_queue "
                f"{self._max_queue}); retry later"
            )
        if self._max_queue_tokens and self._queued_tokens + tokens > self._max_queue_tokens:
            raise ResourceExhaustedError(
                f"queue full: {self._queued_tokens} tokens waiting, request has {tokens} "
                f"(max_queue_tokens {self._max_queue_tokens}); retry later"
            )
        item = PendingRequest.create(
            request_id,
            batch,
            arrival=arrival,
            deadline=deadline,
            pad_multiple=self._pad_multiple,
            sharing=self._sharing,
            budget=self.budget,
            base=self.engine_info().served(batch.model).base,
        )
        self._enqueue(item)
        self._queued_requests += 1
        self._queued_tokens += tokens
        self._update_queue_metrics()
        try:
            return await item.future
        finally:
            if not item.future.done():
                item.future.cancel()
            if item.future.cancelled() and item in self._queue:
                self._drop(item, "cancelled")  # free its queue slot now, not after the step
            self._wake.set()

    @property
    def weights_version(self) -> str:
        """The default set's version being served: the engine's (its one owner)."""
        return self._engine.info().weights_version

    def engine_info(self) -> ModelInfo:
        """The engine's description now (its weight sets with their versions)."""
        return self._engine.info()

    async def swap_weights(
        self, swap: Callable[[Engine], str], served: str = ""
    ) -> tuple[str, str, ModelInfo]:
        """Runs ``swap(engine)`` (which changes the weights of the set or adapter ``served``
        names and returns their new version) between steps, after every request already
        accepted; later requests wait for it.

        Returns:
            ``(new_version, previous_version of served ("" for a new adapter), engine.info()
            after the swap)``.

        Raises:
            Whatever ``swap`` raises (the engine keeps its old weights);
            :class:`UnavailableError` when shutting down or the engine was lost.
        """
        self._check_open()

        def run() -> tuple[str, str, ModelInfo]:
            models = self._engine.info().models
            previous = next((m.weights_version for m in models if m.name == served), "")
            previous = previous if served else self._engine.info().weights_version
            version = swap(self._engine)
            return str(version), previous, self._engine.info()

        barrier = Barrier(run, asyncio.get_running_loop().create_future())
        self._enqueue(barrier)
        return await barrier.future

    def run_on_engine(self, fn: Callable[[Engine], object]) -> asyncio.Future:
        """Queues ``fn(engine)`` on the engine thread at once, to run between two steps
        without waiting for the queued requests (a weight push stages its tensors so
        while scoring goes on); returns the future of its result. Calls run in the order
        they were queued: an abort queued after a tensor's staging runs after it, even
        when the caller never awaited the staging.

        Raises:
            UnavailableError: (at once) when shutting down or the engine was lost. The
            future holds whatever ``fn`` raises (a :class:`WorkerLostError` is fatal,
            as in a step).
        """
        self._check_open()
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn, self._engine)
        future.add_done_callback(self._check_lost)
        return future

    def _check_lost(self, future: asyncio.Future) -> None:
        if not future.cancelled() and isinstance(future.exception(), WorkerLostError):
            self._fatal(future.exception())

    @property
    def queue_depth(self) -> int:
        """Requests waiting for (more of) their sequences to be dispatched."""
        return self._queued_requests

    @property
    def barriers_waiting(self) -> int:
        """Weight loads queued behind the requests accepted before them."""
        return sum(isinstance(item, Barrier) for item in self._queue)

    async def close(self, reason: str = "server is shutting down") -> None:
        """Fails everything still waiting with UNAVAILABLE and stops the scheduler."""
        if self._closed is None:
            self._closed = UnavailableError(reason)
        self._fail_all(self._closed)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed is not None:
            raise type(self._closed)(self._closed.reason)

    def _enqueue(self, item: PendingRequest | Barrier) -> None:
        self._queue.append(item)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="batcher")
        self._wake.set()

    def _update_queue_metrics(self) -> None:
        if self._metrics is not None:
            self._metrics.set_queue(self._queued_requests, self._queued_tokens)

    def _dequeue(self, item: PendingRequest) -> None:
        self._queue.remove(item)
        self._queued_requests -= 1
        self._queued_tokens -= item.remaining_tokens
        item.remaining_tokens = 0
        self._update_queue_metrics()

    def _drop(self, item: PendingRequest, reason: str) -> None:
        logger.info("request_id=%s dropped from the queue: %s", item.request_id, reason)
        if not item.future.done():
            item.future.cancel()
        if self._metrics is not None:
            self._metrics.dropped.inc()
        self._dequeue(item)

    def _prune(self, now: float) -> None:
        for item in [i for i in self._queue if isinstance(i, PendingRequest) and i.dropped(now)]:
            self._drop(item, "cancelled" if item.future.cancelled() else "deadline expired")
        for item in [i for i in self._queue if isinstance(i, Barrier) and i.future.done()]:
            self._queue.remove(item)

    def _window(self) -> list[PendingRequest]:
        """Requests that may share the next step (before any barrier, head first)."""
        head = self._queue[0]
        if head.solo:
            return [head]
        window, tokens = [], 0
        for item in self._queue:
            if isinstance(item, Barrier) or tokens >= _WINDOW_BUDGETS * self.budget:
                break
            if not item.solo and item.group == head.group:
                window.append(item)
                tokens += item.remaining_tokens
        return window

    def _launch_delay(self, window: list[PendingRequest], now: float) -> float:
        head = window[0]
        if head.solo or head.num_steps > 0:
            return 0.0  # nothing can join it, or it already waited
        if any(isinstance(item, Barrier) for item in self._queue):
            return 0.0  # later requests wait behind the barrier: nothing else can join
        if sum(int(i.remaining_costs().sum()) for i in window) >= self.budget:
            return 0.0
        return head.arrival + self._max_wait_s - now

    async def _run(self) -> None:
        try:
            await self._schedule()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave requests hanging
            logger.critical("batcher scheduler failed", exc_info=exc)
            self._fatal(UnavailableError(f"batcher failed: {type(exc).__name__}"))

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while self._closed is None:
            self._wake.clear()
            now = time.monotonic()
            self._prune(now)
            if not self._queue:
                await self._wake.wait()
                continue
            head = self._queue[0]
            if isinstance(head, Barrier):
                self._queue.popleft()
                await self._run_barrier(loop, head)
                continue
            window = self._window()
            delay = self._launch_delay(window, now)
            if delay > 0:
                try:
                    await asyncio.wait_for(self._wake.wait(), delay)
                except TimeoutError:
                    pass
                continue
            window = self._pinned_to_served(window)
            if window:
                await self._run_step(loop, window)

    def _pinned_to_served(self, window: list[PendingRequest]) -> list[PendingRequest]:
        """The requests of ``window`` the served version may score; those pinned to
        another version fail (FAILED_PRECONDITION) and leave the queue."""
        if not any(item.batch.weights_version for item in window):
            return window
        info, kept = self.engine_info(), []
        for item in window:
            try:
                served = info.served(item.batch.model).weights_version
                check_pinned_version(item.batch.weights_version, served)
            except WrongVersionError as exc:
                logger.info("request_id=%s refused: %s", item.request_id, exc.reason)
                if item in self._queue:
                    self._dequeue(item)
                if not item.future.done():
                    item.future.set_exception(exc)
            else:
                kept.append(item)
        return kept

    async def _run_barrier(self, loop, barrier: Barrier) -> None:
        try:
            result = await loop.run_in_executor(self._executor, barrier.fn)
        except WorkerLostError as exc:
            self._fatal(exc, extra=[barrier])
            return
        except Exception as exc:  # the engine keeps its old weights
            if not barrier.future.done():
                barrier.future.set_exception(exc)
            return
        if not barrier.future.done():
            barrier.future.set_result(result)

    def _plan(self, window: list[PendingRequest]) -> list[tuple[PendingRequest, np.ndarray]]:
        taken = fill_step([item.remaining_costs() for item in window], self.budget)
        pieces = []
        for item, positions in zip(window, taken, strict=True):
            if positions.size == 0:
                continue
            idx, tokens = item.take(positions)
            self._queued_tokens -= tokens
            if item.remaining.size == 0:
                self._queue.remove(item)
                self._queued_requests -= 1
            pieces.append((item, idx))
        self._update_queue_metrics()
        return pieces

    async def _run_step(self, loop, window: list[PendingRequest]) -> None:
        pieces = self._plan(window)
        start = time.monotonic()
        for item, _ in pieces:
            if item.first_start is None:
                item.first_start = start
        while True:
            step = merge_batches(step_pieces(pieces, self.engine_info))
            self._running = [item for item, _ in pieces]
            try:
                output = await loop.run_in_executor(self._executor, self._engine.score, step)
                break
            except WorkerLostError as exc:
                self._fatal(exc)
                return
            except InvalidRequestError as exc:  # one request's data: the others run again
                pieces = await self._without_invalid(loop, pieces, exc)
                if not pieces:
                    return
            except Exception as exc:
                ids = ",".join(item.request_id for item in self._running)
                logger.error("engine step failed for request_ids=%s", ids, exc_info=exc)
                self._fail_step(exc)
                return
        elapsed = time.monotonic() - start
        self.steps_run += 1
        if self._metrics is not None:
            padded = int(padded_lengths(step.lengths, self._pad_multiple).sum())
            self._metrics.observe_step(step.num_tokens, padded, self.budget, elapsed)
        try:
            self._distribute(step, output, pieces, elapsed)
        except Exception as exc:  # malformed engine output
            logger.error("engine output does not match its step", exc_info=exc)
            self._fail_step(exc)
        self._running = []

    def _distribute(self, step: ScoreBatch, output: ScoreOutput, pieces, elapsed: float) -> None:
        first = 0
        for item, idx in pieces:
            item.record_step(step, output, np.arange(first, first + idx.size), idx, elapsed)
            first += idx.size
            if item.remaining.size == 0 and not item.future.done():
                if self._metrics is not None:
                    self._metrics.tokens_scored.inc(item.batch.num_tokens)
                item.future.set_result(item.result())

    async def _without_invalid(self, loop, pieces, exc: InvalidRequestError) -> list:
        """The pieces of a step the engine refused, less the requests that fail alone.

        Each request is checked on its own (``engine.check``, no forward); those that
        fail get their own error, which names their own sequence. When none fails
        alone, the step's error goes to all of them and nothing is left to run.
        """
        left = []
        for item, idx in pieces:
            try:
                await loop.run_in_executor(self._executor, self._engine.check, item.batch)
            except InvalidRequestError as own:
                logger.info("request_id=%s refused by the engine: %s", item.request_id, own)
                if item in self._queue:
                    self._dequeue(item)
                if not item.future.done():
                    item.future.set_exception(own)
            else:
                left.append((item, idx))
        if len(left) == len(pieces):
            self._running = [item for item, _ in pieces]
            self._fail_step(exc)
            return []
        return left

    def _fail_step(self, exc: BaseException) -> None:
        for item in self._running:
            if item in self._queue:
                self._dequeue(item)
            if not item.future.done():
                item.future.set_exception(exc)
        self._running = []

    def _fatal(self, exc: UnavailableError, extra: list[Barrier] = ()) -> None:
        logger.critical("engine unusable: %s; failing all requests", exc.reason)
        self._closed = exc
        for barrier in extra:
            if not barrier.future.done():
                barrier.future.set_exception(exc)
        self._fail_all(exc)
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for item in list(self._queue) + self._running:
            if not item.future.done():
                item.future.set_exception(exc)
        self._queue.clear()
        self._running = []
        self._queued_requests = 0
        self._queued_tokens = 0
        self._update_queue_metrics()

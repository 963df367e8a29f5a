"""Which Scorer calls may run now, and the calls running: :class:`CallGate`.

The one readiness source of rank 0's server. The servicer asks it before each call
(and each stream message); health only publishes the transitions it makes. The
drain (:meth:`CallGate.drain`, then the parking around ``server.stop()``) is
driven by :meth:`megascore_server.lifecycle.ServerHandles.stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from megascore.api.errors import UnavailableError
from megascore_server.health import ScorerHealth

LOADING_MESSAGE = (
    "server is starting: model loading on every rank (health NOT_SERVING until it is "
    "loaded); retry later"
)
NOT_SERVING_MESSAGE = "server is not serving (starting up or draining)"
SHUTTING_DOWN_MESSAGE = "server shutting down: retry on another replica"


class CallGate:
    """Whether Scorer calls may run now, and the calls running: the one readiness source.

    Loading (no engine) -> attached -> serving (:meth:`open`) -> draining
    (:meth:`drain`), or lost (:meth:`lose`: a rank died). The servicer asks
    :meth:`check` and enters every call through :meth:`call`; health publishes the
    transitions made here and decides nothing itself.

    Args:
        health: publishes SERVING / NOT_SERVING.
    """

    def __init__(self, health: ScorerHealth):
        self._health = health
        self._attached = False
        self._serving = False
        self._closed = False  # drained or lost: never serving again
        self.draining = False
        self._parked: asyncio.Event | None = None  # set: parked calls get UNAVAILABLE
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._wakers: set[Callable[[], None]] = set()

    def engine_attached(self) -> None:
        """The engine is wired in: calls that need no health (GetModelInfo) may run."""
        self._attached = True

    @property
    def serving(self) -> bool:
        return self._serving

    async def open(self) -> None:
        """Started with an engine attached: SERVING, unless already drained or lost."""
        self._serving = self._attached and not self._closed
        if self._serving:
            await self._health.set_serving()

    def lose(self, reason: str) -> None:
        """A rank is lost: refuse scoring at once; health NOT_SERVING for good."""
        self._serving, self._closed = False, True
        asyncio.get_running_loop().create_task(self._health.shut_down(reason))

    async def drain(self, reason: str) -> None:
        """New calls (and new stream messages) fail fast with UNAVAILABLE from now on;
        open streams are woken (see :meth:`waking`); health NOT_SERVING for good."""
        self._serving, self._closed, self.draining = False, True, True
        for wake in list(self._wakers):
            wake()
        await self._health.shut_down(reason)  # after the flag: no call slips in between

    def check(self, *, serving: bool = True) -> None:
        """Raises :class:`UnavailableError` unless a call may run now.

        Args:
            serving: the call needs health SERVING (scoring); False: an attached
                engine is enough (model info, weight loads).
        """
        if self.draining:
            raise UnavailableError(SHUTTING_DOWN_MESSAGE)
        if not self._attached:
            raise UnavailableError(LOADING_MESSAGE)
        if serving and not self._serving:
            raise UnavailableError(NOT_SERVING_MESSAGE)

    async def admit(self) -> None:
        """Refuses a new call while draining (once released, when parked)."""
        if not self.draining:
            return
        if self._parked is not None:
            await self._parked.wait()
        raise UnavailableError(SHUTTING_DOWN_MESSAGE)

    @contextlib.asynccontextmanager
    async def call(self):
        """Admits a call (:meth:`admit`) and counts it as running until it ends."""
        self._active += 1
        self._idle.clear()
        try:
            await self.admit()
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    @contextlib.contextmanager
    def waking(self, wake: Callable[[], None]):
        """Calls ``wake()`` when the drain begins, while inside (an idle open stream)."""
        self._wakers.add(wake)
        try:
            yield
        finally:
            self._wakers.discard(wake)

    @property
    def active_calls(self) -> int:
        """Calls entered through :meth:`call` and still running."""
        return self._active

    async def wait_idle(self, timeout: float) -> bool:
        """Waits up to ``timeout`` s for the running calls to end; True when none is left."""
        if self._active == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), max(timeout, 0.0))
        except TimeoutError:
            return False
        return True

    def park_new_calls(self) -> None:
        """New calls wait (unanswered) until :meth:`release_parked`, then fail UNAVAILABLE.

        For the instant grpc core shuts down: a client whose call is parked sends
        nothing new, and a call that reaches grpc core after its shutdown began is
        cancelled (CANCELLED) before any handler sees it.
        """
        self.draining = True
        if self._parked is None:
            self._parked = asyncio.Event()

    def release_parked(self) -> None:
        """Parked (and later) calls fail with UNAVAILABLE now."""
        if self._parked is not None:
            self._parked.set()

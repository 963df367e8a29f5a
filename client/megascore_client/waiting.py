"""Riding out a server restart: the re-send schedule behind ``wait_for_server_s``.

gRPC's own retry policy (:class:`~megascore_client.channel.RetryPolicy`) is capped at
5 attempts, a few seconds with the default backoff, while a restarted ``megascore
serve`` refuses connections and then answers UNAVAILABLE ("server is starting: model
loading") for tens of seconds. With ``wait_for_server_s > 0`` the clients re-send a
unary request that still ends in UNAVAILABLE after gRPC's retries, on the schedule of
:class:`ServerWait`: a backoff of :data:`INITIAL_BACKOFF_S` doubling up to
:data:`MAX_BACKOFF_S`, each delay jittered by +-:data:`JITTER` (as gRPC jitters its
own), until the server answers, ``wait_for_server_s`` has passed since the first
UNAVAILABLE, or the request's deadline (its ``timeout``) would be passed.

Only UNAVAILABLE is re-sent, and only by the methods that are safe to repeat (Score,
including each part of a split batch, and GetModelInfo); see ``docs/client.md``.

A Score request pinned to a weights version (``weights_version=``) that a replica
refuses with FAILED_PRECONDITION (it serves another version) is re-sent too, whatever
``wait_for_server_s``: at most :data:`PIN_RESENDS` times, after
:data:`PIN_BACKOFF_S`, then twice that, ... (0.1 + 0.2 + 0.4 s), within the request's
deadline. Over a ``round_robin`` channel each re-send goes to the next replica; over
one replica it gives an in-progress push time to commit.

gRPC's ``wait_for_ready`` is not used: while the port is closed it turns the call's
"failed to connect" UNAVAILABLE into a DEADLINE_EXCEEDED at the deadline (and waits
forever without one), which would also hide a wrong target or a TLS mismatch.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

from megascore_client.errors import ScoringError

__all__ = ["ServerWait", "check_wait", "pinned_version", "time_left"]

INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 5.0
JITTER = 0.2
MIN_ATTEMPT_S = 0.1  # no re-send with less time than this left before the deadline
PIN_RESENDS = 3
PIN_BACKOFF_S = 0.1


def check_wait(wait_for_server_s: float, timeout: float | None) -> float:
    """Validates ``wait_for_server_s`` against the client's default ``timeout``.

    Returns:
        ``wait_for_server_s`` as a float.

    Raises:
        ValueError: negative / not finite, or not below ``timeout`` (the re-sends
            happen inside each request's deadline, so the wait would be cut short).
    """
    wait = float(wait_for_server_s)
    if not (math.isfinite(wait) and wait >= 0):
        raise ValueError(f"wait_for_server_s must be a finite number >= 0, got {wait_for_server_s}")
    if wait > 0 and timeout is not None and timeout <= wait:
        raise ValueError(
            f"timeout ({timeout:g} s) must exceed wait_for_server_s ({wait:g} s): the "
            "re-sends happen inside each request's deadline; use e.g. "
            f"timeout={wait + 60:g} (wait + the longest scoring time) or timeout=None"
        )
    return wait


def time_left(deadline: float | None, clock: Callable[[], float] = time.monotonic):
    """Seconds from now to ``deadline`` (a ``time.monotonic`` value; None = no deadline)."""
    return None if deadline is None else max(deadline - clock(), 0.001)


class ServerWait:
    """The re-send schedule of one request, started at its first UNAVAILABLE.

    Args:
        budget_s: ``wait_for_server_s``: how long to keep re-sending.
        deadline: ``time.monotonic()`` value the request must end by (None = none).
        clock: monotonic clock (tests pass a fake one).
        rand: uniform [0, 1) source for the jitter.
    """

    def __init__(
        self,
        budget_s: float,
        deadline: float | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ):
        self.budget_s = budget_s
        self.deadline = deadline
        self._clock = clock
        self._rand = rand
        self.started = clock()
        self.resends = 0
        self.pin_resends = 0
        self._backoff = INITIAL_BACKOFF_S
        self._reason = ""

    def next_delay(self) -> float | None:
        """Seconds to sleep before the next re-send, or None to give up.

        The delay is the current backoff +-``JITTER``, cut to end with the budget (so
        the last re-send goes out when it runs out); the backoff then doubles up to
        ``MAX_BACKOFF_S``. None once the budget is spent, or when the re-send would
        start less than ``MIN_ATTEMPT_S`` before the deadline.
        """
        now = self._clock()
        left = self.started + self.budget_s - now
        if left <= 0:
            self._reason = f"wait_for_server_s={self.budget_s:g} spent"
            return None
        delay = min(self._backoff * (1.0 + JITTER * (2.0 * self._rand() - 1.0)), left)
        if self.deadline is not None and now + delay + MIN_ATTEMPT_S > self.deadline:
            self._reason = "the request's timeout would pass before the next re-send"
            return None
        self._backoff = min(self._backoff * 2.0, MAX_BACKOFF_S)
        self.resends += 1
        return delay

    def next_pin_delay(self) -> float | None:
        """Seconds to sleep before re-sending a pinned request a replica refused (it
        serves another weights version), or None once :data:`PIN_RESENDS` re-sends were
        made or the deadline would pass."""
        delay = PIN_BACKOFF_S * 2.0**self.pin_resends
        if self.pin_resends >= PIN_RESENDS or (
            self.deadline is not None and self._clock() + delay + MIN_ATTEMPT_S > self.deadline
        ):
            return None
        self.pin_resends += 1
        return delay

    def waited(self) -> float:
        """Seconds since the first UNAVAILABLE of the request."""
        return self._clock() - self.started

    def gave_up(self, error: ScoringError) -> ScoringError:
        """The error to raise after :meth:`next_delay` returned None: ``error``'s code
        and details, plus how long the client waited and why it stopped."""
        waited = self._clock() - self.started
        return ScoringError(
            error.code,
            f"{error.details} [waited {waited:.1f} s for the server, {self.resends} "
            f"re-sends; gave up: {self._reason}]",
        )


def pinned_version(request) -> str:
    """The weights version a Score request is pinned to ("" for none, or another message)."""
    options = getattr(request, "options", None)
    return options.weights_version if options is not None else ""

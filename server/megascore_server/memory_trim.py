"""Giving back the memory a burst of large requests, or a stalled stream, leaves in rank
0's process.

A burst of large requests on either front (4 MiB gRPC messages or HTTP bodies from 20
clients) left the server 100-300 MB larger for good, for two reasons: reference cycles
(the traceback of a refused request, its frames holding the request's buffers) that
only the cyclic collector frees, which an idle server does not run; and glibc, which
keeps freed pages for the next allocation (its mmap threshold grows with the buffers it
has seen, so 4 MiB messages come from its heaps, not from mmap). Once large requests
stop coming (:data:`TRIM_AFTER_S` after the last), :class:`MemoryTrim` runs a full
collection (ms: start-up's objects are frozen out of it when the engine is attached,
``megascore_server.lifecycle``) and then ``malloc_trim(0)`` in a thread (ctypes
releases the GIL; it returns only pages nothing uses). Where libc has no
``malloc_trim`` (musl, macOS) only the collection runs.

A ScoreStream whose client sends and does not read leaves nothing large, but many small
buffers: its reads stop at ``max_stream_inflight`` answers, and what its client keeps
sending fills grpc core's receive window of the stream (grown by grpc's BDP probe to
megabytes). grpc frees them when the stream ends, and glibc kept them: four such streams
left the server ~35 MiB (5 %) larger for good (`scripts/flood.py --attacks unread`;
+0.1-0.3 % with a trim). So a stream whose reads waited for a slot (its client sent
more than it had answers written) asks for the same trim when it ends
(:meth:`MemoryTrim.soon`).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import os

LARGE_BYTES = 256 << 10
"""A request message or body of this size or more is large."""
TRIM_AFTER_S = 1.0
"""The trim runs this long after the last large request."""
MALLOC_ARENAS = 2
"""glibc arenas of rank 0's process (:func:`limit_malloc_arenas`)."""
_M_ARENA_MAX = -8  # mallopt's parameter (malloc.h)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
_malloc_trim = getattr(_libc, "malloc_trim", None)
_mallopt = getattr(_libc, "mallopt", None)


def limit_malloc_arenas() -> None:
    """Caps glibc's malloc arenas at :data:`MALLOC_ARENAS` for the threads that start
    from now on (unless ``MALLOC_ARENA_MAX`` is set). glibc gives each new thread that
    allocates at once with another its own 64 MiB arena (up to 8 per core): the request
    buffers of grpc's and the front's threads were spread over many of them, and a burst
    of 4 MiB bodies left the server +12.6 % larger after the trim (+2.2 % with 2)."""
    if _mallopt is not None and "MALLOC_ARENA_MAX" not in os.environ:
        _mallopt(_M_ARENA_MAX, MALLOC_ARENAS)


def trim() -> None:
    """Returns the free pages of every malloc arena of this process to the system."""
    if _malloc_trim is not None:
        _malloc_trim(0)


class MemoryTrim:
    """Trims once a burst of large requests is over (one per server, both fronts)."""

    def __init__(self):
        self._timer: asyncio.TimerHandle | None = None

    def saw(self, num_bytes: int) -> None:
        """Notes a request of ``num_bytes``; call it on the server's event loop."""
        if num_bytes >= LARGE_BYTES:
            self.soon()

    def soon(self) -> None:
        """Trims :data:`TRIM_AFTER_S` from now (a later call moves it); call it on the
        server's event loop."""
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(TRIM_AFTER_S, self._trim, loop)

    def _trim(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        gc.collect()  # cycles (a refused request's traceback) that hold large buffers
        loop.run_in_executor(None, trim)

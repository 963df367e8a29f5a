"""Linux ``/proc`` readers: a process's state, family, environment, CPU time and memory.

Every reader answers for a process that may exit at any moment: a process that is gone
(or caught mid-exit with a short read) reads as absent (None, False, 0, ``{}``), never
as an error. Used by :mod:`megascore_server.serve_process` and by the tests, benches and
scripts that watch the server processes they started.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

CLK_TCK = os.sysconf("SC_CLK_TCK")
"""Clock ticks per second: the unit of the CPU times in ``/proc/PID/stat``."""


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of ``/proc/PID/stat`` after the command name (``[0]`` is the state)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 12 else None


def stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, ppid, pgid)`` of ``pid``, or None when it does not exist."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    try:
        return fields[0], int(fields[1]), int(fields[2])
    except ValueError:
        return None


def alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie (exited, not yet reaped)."""
    state = stat(pid)
    return state is not None and state[0] != "Z"


def all_pids() -> list[int]:
    """Every process id in ``/proc``."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _live_where(index: int, value: int) -> list[int]:
    """Live processes whose stat field ``index`` (1: ppid, 2: pgid) equals ``value``."""
    out = []
    for pid in all_pids():
        state = stat(pid)
        if state is not None and state[index] == value and state[0] != "Z":
            out.append(pid)
    return out


def children(pid: int) -> list[int]:
    """Live (non-zombie) direct children of ``pid``."""
    return _live_where(1, pid)


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, grandchildren ...)."""
    found, frontier = [], [pid]
    while frontier:
        kids = [c for p in frontier for c in children(p)]
        found += kids
        frontier = kids
    return found


def group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid``."""
    return _live_where(2, pgid)


def env_of(pid: int) -> dict[str, str]:
    """The environment ``pid`` was started with (``{}`` when gone or not readable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def cpu_seconds(*pids: int) -> float:
    """User + system CPU seconds so far of ``pids`` together (every thread; gone: 0)."""
    ticks = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / CLK_TCK


def status_kib(pid: int, field: str) -> int:
    """A KiB field of ``/proc/PID/status`` (``VmRSS``, ``VmHWM`` ...); 0 when gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def rss_kb(pid: int) -> int:
    """VmRSS of ``pid`` in KiB (0 when gone)."""
    return status_kib(pid, "VmRSS")


def reset_peak_rss(pid: int) -> None:
    """Resets ``VmHWM`` of ``pid`` to its current RSS (``/proc/PID/clear_refs``)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


class Usage(NamedTuple):
    """What a process holds now."""

    rss_kib: int
    fds: int
    threads: int


def usage(pid: int) -> Usage | None:
    """RSS, open file descriptors and threads of ``pid``; None when it is gone."""
    try:
        rss = threads = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        return None
    return Usage(rss, fds, threads)


def wait_gone(pids: Iterable[int], timeout: float = 10.0) -> list[int]:
    """Waits until none of ``pids`` is alive; returns those still alive after ``timeout``."""
    pids = list(pids)
    end = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() >= end:
            return left
        time.sleep(0.1)

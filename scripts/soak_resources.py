"""Per-process resources of a soak run: RSS, open file descriptors, threads.

:class:`ResourceSampler` reads ``/proc`` every ``interval_s`` seconds for each role (a
function returning the role's pids: a server's launcher and ranks, the soak process
itself) and keeps, per role, ``(t, pids, rss_kib, fds, threads)`` summed over its
processes. :func:`growth` compares the median of the first window after the warm-up
with the median of the last window, for a role whose processes did not change in
between (a replica restarted by the chaos loop starts a new incarnation: it is
reported, not judged).
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

from megascore_server.procfs import Usage, usage

METRICS = Usage._fields  # ("rss_kib", "fds", "threads")


class ResourceSampler:
    """Samples every role on a thread until :meth:`stop`.

    Args:
        roles: role name -> function returning its pids now.
        interval_s: seconds between samples.
    """

    def __init__(self, roles: dict, interval_s: float):
        self.roles = roles
        self.interval_s = interval_s
        self.start = time.monotonic()
        self.samples: dict[str, list[tuple]] = {name: [] for name in roles}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def _sample(self) -> None:
        now = time.monotonic() - self.start
        for name, pids_of in self.roles.items():
            try:
                pids = tuple(sorted(pids_of()))
            except Exception:  # a role whose process is between incarnations
                pids = ()
            values = [v for v in (usage(p) for p in pids) if v is not None]
            if pids and len(values) == len(pids):
                sums = tuple(sum(v[i] for v in values) for i in range(3))
                self.samples[name].append((now, pids, *sums))

    def stop(self) -> dict[str, list[tuple]]:
        """Stops sampling after one last sample of every role (a replica restarted less
        than an interval before the end is still seen: a loaded machine restarts slowly)."""
        self._stop.set()
        self._thread.join(30)
        self._sample()
        return self.samples


def growth(samples: list[tuple], warmup_s: float, window: int) -> dict | None:
    """Growth of each metric from the first window after ``warmup_s`` to the last one.

    Returns None when the role has fewer than ``2 * window`` samples after the warm-up;
    ``{"restarted": True, ...}`` when its processes changed after the warm-up (only the
    last incarnation is judged, if it has enough samples).
    """
    after = [s for s in samples if s[0] >= warmup_s]
    restarted = len({s[1] for s in after}) > 1
    if restarted:
        last = after[-1][1]
        after = [s for s in after if s[1] == last]
        after = after[window:]  # the new incarnation's own warm-up
    if len(after) < 2 * window:
        return {"restarted": restarted, "judged": False} if restarted else None
    out = {"restarted": restarted, "judged": True, "samples": len(after)}
    for i, name in enumerate(METRICS):
        first = statistics.median(s[2 + i] for s in after[:window])
        last = statistics.median(s[2 + i] for s in after[-window:])
        out[name] = {"first": first, "last": last, "growth": last / first - 1 if first else 0.0}
    return out


def curves(samples: dict[str, list[tuple]], points: int = 13) -> dict[str, list[tuple]]:
    """A few evenly spaced samples per role: (minute, rss MiB, fds, threads)."""
    out = {}
    for name, rows in samples.items():
        if not rows:
            continue
        step = max(1, (len(rows) - 1) // (points - 1))
        picked = rows[::step]
        if picked[-1] is not rows[-1]:
            picked.append(rows[-1])
        out[name] = [(round(r[0] / 60, 1), round(r[2] / 1024, 1), r[3], r[4]) for r in picked]
    return out


def write_csv(samples: dict[str, list[tuple]], path: Path) -> None:
    """Every sample: ``role,t_s,pids,rss_kib,fds,threads``."""
    with path.open("w") as f:
        f.write("role,t_s,pids,rss_kib,fds,threads\n")
        for name, rows in samples.items():
            for t, pids, rss, fds, threads in rows:
                f.write(f"{name},{t:.1f},{'+'.join(map(str, pids))},{rss},{fds},{threads}\n")

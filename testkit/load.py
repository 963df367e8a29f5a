"""Load generator shared by ``tests/reliability/test_load.py`` and ``scripts/soak.py``.

Clients of three kinds run concurrently against one server until a deadline:

* ``unary``: a sync :class:`ScoringClient` calling ``score`` in a loop;
* ``stream``: a sync client keeping a window of batches in flight on one ScoreStream;
* ``async``: an :class:`AsyncScoringClient` with several concurrent ``score`` tasks.

Every answer is compared with a reference computed beforehand by one client, one
call at a time (:func:`reference_results`); a failed call or a differing answer is
recorded, never retried. :class:`RssSampler` records the resident memory of the
server's processes meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable

import numpy as np

from megascore_client import AsyncScoringClient, ScoringClient, ScoringError
from testkit.reference import LOSSES, VOCAB, Case

KINDS = ("unary", "stream", "async")


def make_cases(count: int, seed: int = 0, max_len: int = 96, max_seqs: int = 6) -> list[Case]:
    """``count`` random cases: 1..max_seqs sequences of 1..max_len tokens, mixed options."""
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(count):
        lengths = rng.integers(1, max_len + 1, int(rng.integers(1, max_seqs + 1)))
        cases.append(
            Case(
                [rng.integers(0, VOCAB, int(n)).tolist() for n in lengths],
                top_k=int(rng.choice([0, 0, 1, 4])),
                temperature=float(rng.choice([1.0, 1.0, 0.8, 2.0])),
            )
        )
    return cases


def reference_results(client: ScoringClient, cases: list[Case]) -> list:
    """Each case scored alone, sequentially, by one client."""
    return [case.score(client) for case in cases]


def max_difference(result, ref) -> float:
    """Largest absolute difference between two results of one case (0.0 = bit-identical).

    Differing shapes, ids, token counts or loss names count as infinity.
    """
    worst = 0.0
    if len(result.logprobs) != len(ref.logprobs) or result.top_k != ref.top_k:
        return float("inf")
    if not np.array_equal(result.num_tokens, ref.num_tokens):
        return float("inf")
    pairs = list(zip(result.logprobs, ref.logprobs, strict=True))
    if result.top_k:
        if any(
            not np.array_equal(a, b) for a, b in zip(result.top_k_ids, ref.top_k_ids, strict=True)
        ):
            return float("inf")
        pairs += list(zip(result.top_k_logprobs, ref.top_k_logprobs, strict=True))
    if result.loss.keys() != ref.loss.keys():
        return float("inf")
    pairs += [(result.loss[name], ref.loss[name]) for name in result.loss]
    for a, b in pairs:
        if a.shape != b.shape:
            return float("inf")
        if a.size:
            worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - b))))
    return worst


@dataclasses.dataclass
class Stats:
    """What the clients saw (thread-safe through :meth:`record`)."""

    latencies_ms: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {kind: [] for kind in KINDS}
    )
    tokens: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)
    mismatches: list[str] = dataclasses.field(default_factory=list)
    max_diff: float = 0.0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def record(self, kind: str, case: Case, ref, result, latency_ms: float, tolerance: float):
        diff = max_difference(result, ref)
        with self._lock:
            self.latencies_ms[kind].append(latency_ms)
            self.tokens += sum(len(s) for s in case.sequences)
            self.max_diff = max(self.max_diff, diff)
            if diff > tolerance:
                self.mismatches.append(f"{kind} {result.request_id}: differs by {diff}")

    def fail(self, kind: str, error: BaseException) -> None:
        with self._lock:
            self.failures.append(f"{kind}: {type(error).__name__}: {error}")

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.latencies_ms.values())

    def percentiles(self, kind: str | None = None) -> dict[str, float]:
        """p50 / p90 / p99 / max latency in ms (all kinds when ``kind`` is None)."""
        values = (
            list(itertools.chain.from_iterable(self.latencies_ms.values()))
            if kind is None
            else self.latencies_ms[kind]
        )
        if not values:
            return {}
        arr = np.asarray(values)
        return {
            "p50": float(np.percentile(arr, 50)),
            "p90": float(np.percentile(arr, 90)),
            "p99": float(np.percentile(arr, 99)),
            "max": float(arr.max()),
        }


def _unary(target, cases, refs, deadline, stats, tolerance, offset, client_kw):
    with ScoringClient(target, retries=None, **client_kw) as client:
        for i in itertools.count(offset):
            if time.monotonic() >= deadline:
                return
            case = cases[i % len(cases)]
            start = time.perf_counter()
            try:
                result = case.score(client)
            except ScoringError as exc:
                stats.fail("unary", exc)
                continue
            latency = (time.perf_counter() - start) * 1e3
            stats.record("unary", case, refs[i % len(cases)], result, latency, tolerance)


def _stream(target, cases, refs, deadline, stats, tolerance, offset, client_kw, window=4):
    with ScoringClient(target, retries=None, **client_kw) as client:
        try:
            with client.stream(timeout=max(1.0, deadline - time.monotonic()) + 120) as stream:
                inflight = []
                for i in itertools.count(offset):
                    if time.monotonic() >= deadline and not inflight:
                        return
                    if time.monotonic() < deadline and len(inflight) < window:
                        case = cases[i % len(cases)]
                        future = stream.submit(
                            case.sequences,
                            top_k=case.top_k,
                            temperature=case.temperature,
                            losses=LOSSES,
                        )
                        inflight.append((i % len(cases), time.perf_counter(), future))
                        continue
                    index, start, future = inflight.pop(0)
                    result = future.result(timeout=120)
                    latency = (time.perf_counter() - start) * 1e3
                    stats.record("stream", cases[index], refs[index], result, latency, tolerance)
        except (ScoringError, TimeoutError) as exc:
            stats.fail("stream", exc)


def _async(target, cases, refs, deadline, stats, tolerance, offset, client_kw, tasks=3):
    async def worker(client, start_index):
        for i in itertools.count(start_index, tasks):
            if time.monotonic() >= deadline:
                return
            case = cases[i % len(cases)]
            start = time.perf_counter()
            try:
                result = await client.score(
                    case.sequences, top_k=case.top_k, temperature=case.temperature, losses=LOSSES
                )
            except ScoringError as exc:
                stats.fail("async", exc)
                continue
            latency = (time.perf_counter() - start) * 1e3
            stats.record("async", case, refs[i % len(cases)], result, latency, tolerance)

    async def main():
        async with AsyncScoringClient(target, retries=None, **client_kw) as client:
            await asyncio.gather(*(worker(client, offset + t) for t in range(tasks)))

    asyncio.run(main())


_WORKERS: dict[str, Callable] = {"unary": _unary, "stream": _stream, "async": _async}


def run_load(
    target: str,
    cases: list[Case],
    refs: list,
    *,
    duration_s: float,
    clients: dict[str, int],
    tolerance: float = 0.0,
    client_kw: dict | None = None,
    stats: Stats | None = None,
) -> Stats:
    """Runs ``clients`` (kind -> count) against ``target`` for ``duration_s`` seconds.

    Args:
        target: server address.
        cases: the cases to cycle through (each client starts at a different one).
        refs: the reference result of each case.
        duration_s: how long new calls are started; calls in flight then finish.
        clients: number of clients of each kind in :data:`KINDS`.
        tolerance: largest accepted difference from the reference (0 = bit-identical).
        client_kw: extra client arguments (``timeout``, ``token``, ``tls`` ...).
        stats: where to record (a new :class:`Stats` when None).

    Returns:
        The :class:`Stats`.
    """
    stats = stats or Stats()
    client_kw = {"timeout": 120.0, **(client_kw or {})}
    deadline = time.monotonic() + duration_s
    threads = []
    offset = 0
    for kind, count in clients.items():
        for _ in range(count):
            args = (target, cases, refs, deadline, stats, tolerance, offset, client_kw)
            threads.append(threading.Thread(target=_WORKERS[kind], args=args, daemon=True))
            offset += 7
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(duration_s + 300)
        if thread.is_alive():
            stats.fail("load", TimeoutError(f"{thread.name} still running 300 s after the end"))
    return stats


class RssSampler:
    """Samples ``rss()`` (KiB) every ``interval_s`` seconds on a thread until :meth:`stop`."""

    def __init__(self, rss: Callable[[], int], interval_s: float = 1.0):
        self.samples: list[tuple[float, int]] = []
        self._rss = rss
        self._interval = interval_s
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - self._start, self._rss()))
            self._stop.wait(self._interval)

    def stop(self) -> list[tuple[float, int]]:
        self._stop.set()
        self._thread.join(10)
        return self.samples

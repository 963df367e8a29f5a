"""What the changing-weights soak reports: its progress lines, the summary and verdict
(:func:`summarize`), and its section of ``bench/RESULTS.md`` (``--results PATH``),
written between :data:`BEGIN` and :data:`END` (replacing what is there; appended
otherwise; ``bench/run_all.py`` carries the section over when it rewrites the file).
"""

from __future__ import annotations

import collections
import os
import platform
import time
from pathlib import Path

import numpy as np
from soak_resources import curves, growth

MAX_GROWTH = 0.05
"""Largest growth of a server's RSS, fds or threads after the warm-up."""

BEGIN, END = (
    "<!-- soak.py --changing-weights: begin -->",
    "<!-- soak.py --changing-weights: end -->",
)


def _load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def section(summary: dict, argv: list[str], load_start: str) -> str:
    """The markdown section for one run's ``summary`` (``soak_weights._summary``)."""
    s = summary
    trainer, chaos = s["trainer"], s["chaos"]
    lat = s["latency_ms"]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        BEGIN,
        "## Soak with changing weights (`scripts/soak.py --changing-weights`)",
        "",
        f"Written by `python scripts/soak.py {' '.join(argv)}` ({when}, "
        f"{s['duration_s'] / 60:.1f} min, load average {load_start} at the start, "
        f"{_load()} at the end; {platform.machine()}, {os.cpu_count()} cores); rerun it "
        "to update this section. What it does and checks: docs/reliability.md "
        '("Changing-weights soak").',
        "",
        f"**{s['line']}**",
        "",
        "| | |",
        "|---|---:|",
        f"| answered calls (unary / async / stream / cli / http) | "
        f"{sum(s['calls'].values()):,} ({' / '.join(str(s['calls'].get(k, 0)) for k in ('unary', 'async', 'stream', 'cli', 'http'))}) |",  # noqa: E501
        f"| tokens scored | {s['tokens']:,} |",
        f"| pinned requests answered at their pin / refused FAILED_PRECONDITION | "
        f"{s['pinned'].get('answered', 0):,} / {s['pinned'].get('refused', 0):,} |",
        f"| pushes committed (full / delta) | {trainer.get('pushes', 0)} "
        f"({trainer.get('full pushes', 0)} / {trainer.get('deltas', 0)}) |",
        f"| pushes failed by a replica going down (nothing switched / the live ones "
        f"committed) | {sum(v for k, v in trainer['failed'].items() if k.startswith('push'))}"
        f" / {trainer.get('pushes committed on the live replicas only', 0)} |",
        f"| LoadWeights rounds | {trainer.get('loads', 0)} |",
        f"| kills: SIGKILL / SIGTERM during a push / SIGTERM between pushes | "
        f"{chaos.get('SIGKILL', 0)} / {chaos.get('SIGTERM during a push', 0)} / "
        f"{chaos.get('SIGTERM between pushes', 0)} |",
        f"| restarts (down p50 / p99, s) | {chaos.get('restarts', 0)} "
        f"({chaos['down_s'].get('p50', '-')} / {chaos['down_s'].get('p99', '-')}) |",
        f"| weights versions referenced | {s['versions_referenced']} |",
        f"| wrong / stale answers | {len(s['wrong'])} / {len(s['stale'])} |",
        f"| latency p50 / p99 ms, all calls | {lat['all'].get('p50', '-')} / "
        f"{lat['all'].get('p99', '-')} |",
        f"| push p50 / p99 s (set of live replicas) | {s['push_seconds'].get('p50', '-')} / "
        f"{s['push_seconds'].get('p99', '-')} |",
        "",
        "Failures by client and status (all documented: UNAVAILABLE while a replica is "
        "down after the SDK's retries; FAILED_PRECONDITION for pinned requests only):",
        "",
        "| client, status | count |",
        "|---|---:|",
        *(f"| {k} | {v:,} |" for k, v in s["failures"].items()),
        "",
        "Resources after the warm-up (median of the first and the last window; a "
        "restarted replica: its last incarnation, when it lived long enough):",
        "",
        "| process(es) | RSS MiB first -> last | fds | threads | max growth |",
        "|---|---|---|---|---:|",
    ]
    for name, g in s["resources"].items():
        label = f"{name} (the harness, not judged)" if name == "soak" else name
        if not g or not g.get("judged"):
            note = "restarted, last incarnation too short" if g else "too few samples"
            lines.append(f"| {label} | {note} | | | |")
            continue
        rss, fds, thr = g["rss_kib"], g["fds"], g["threads"]
        worst = max(g[m]["growth"] for m in ("rss_kib", "fds", "threads"))
        lines.append(
            f"| {label} | {rss['first'] / 1024:.1f} -> {rss['last'] / 1024:.1f} | "
            f"{fds['first']:.0f} -> {fds['last']:.0f} | {thr['first']:.0f} -> {thr['last']:.0f} "
            f"| {worst:+.2%} |"
        )
    lines += ["", "Resource curves (minute: RSS MiB / fds / threads):", ""]
    for name, points in s["resource_curves"].items():
        lines.append(f"* {name}: " + ", ".join(f"{m}: {r}/{f}/{t}" for m, r, f, t in points))
    lines += ["", END]
    return "\n".join(lines) + "\n"


def write_section(path: Path, text: str) -> None:
    """Replaces the section between the markers of ``path`` (appends it if absent)."""
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        new = head + text.rstrip("\n") + rest.split(END, 1)[1]
    else:
        new = old.rstrip("\n") + "\n\n" + text
    path.write_text(new)


def _percentiles(values) -> dict:
    if not values:
        return {}
    arr = np.asarray(values)
    return {p: round(float(np.percentile(arr, int(p[1:]))), 1) for p in ("p50", "p99")}


def progress(elapsed, ledger, trainer, chaos, sampler) -> str:
    with ledger.lock:
        calls, wrong, stale = sum(ledger.calls.values()), len(ledger.wrong), len(ledger.stale)
        failures = sum(ledger.failures.values())
    rows = sampler.samples.get("replica-tp2") or [(0, (), 0, 0, 0)]
    return (
        f"[{elapsed:7.0f}s] calls {calls} pushes {trainer.stats['pushes']} "
        f"deltas {trainer.stats['deltas']} loads {trainer.stats['loads']} "
        f"kills {sum(v for k, v in chaos.stats.items() if k.startswith('SIG'))} "
        f"restarts {chaos.stats['restarts']} failures {failures} wrong {wrong} stale {stale} "
        f"tp2 rss {rows[-1][2] / 1024:.0f} MiB fds {rows[-1][3]} threads {rows[-1][4]}"
    )


def summarize(args, elapsed, ledger, trainer, chaos, samples, exits, stuck, http) -> dict:
    window = max(3, int(args.window / args.sample_every))
    resources = {name: growth(rows, args.warmup, window) for name, rows in samples.items()}
    latencies = [v for values in ledger.latency_ms.values() for v in values]
    failures = collections.Counter()
    for (_kind, code), n in ledger.failures.items():
        failures[code] += n
    problems = []
    if ledger.wrong:
        problems.append(f"{len(ledger.wrong)} wrong answers, e.g. {ledger.wrong[:3]}")
    if ledger.stale:
        problems.append(f"{len(ledger.stale)} stale answers, e.g. {ledger.stale[:3]}")
    if ledger.unexpected:
        problems.append(f"{len(ledger.unexpected)} unexpected failures: {ledger.unexpected[:5]}")
    if trainer.splits:
        problems.append(f"pushes not all-or-none: {trainer.splits[:5]}")
    if trainer.errors:
        problems.append(f"trainer steps failed: {trainer.errors[:5]}")
    problems += chaos.problems
    for kind in ("unary", "async", "stream", "cli") + (("http",) if http and args.http else ()):
        if not ledger.calls[kind]:
            problems.append(f"no {kind} call answered")
    if not trainer.stats["pushes"]:
        problems.append(f"pushes: {dict(trainer.stats)}")
    for name, g in resources.items():
        if name == "soak":  # the harness itself: reported (its threads vary with pushes)
            continue
        for metric in ("rss_kib", "fds", "threads"):
            if g and g.get("judged") and g[metric]["growth"] > MAX_GROWTH:
                problems.append(f"{name} {metric} grew {g[metric]['first']} -> {g[metric]['last']}")
    if stuck:
        problems.append(f"clients still running: {stuck}")
    for name, code in exits.items():
        if code not in (0, "down at the end (chaos)"):
            problems.append(f"{name} exited {code}")
    kills = sum(v for k, v in chaos.stats.items() if k.startswith("SIG"))
    p = _percentiles(latencies)
    verdict = "PASS" if not problems else "FAIL: " + "; ".join(problems)
    line = (
        f"soak: {verdict} -- {elapsed:.0f} s, calls {sum(ledger.calls.values())}, "
        f"tokens {ledger.tokens}, pushes {trainer.stats['pushes']} "
        f"({trainer.stats['deltas']} deltas), loads {trainer.stats['loads']}, kills {kills}, "
        f"restarts {chaos.stats['restarts']}, wrong {len(ledger.wrong)}, "
        f"stale {len(ledger.stale)}, failures {dict(failures) or 0}, "
        f"p50 {p.get('p50', '-')} ms, p99 {p.get('p99', '-')} ms"
    )
    return {
        "line": line,
        "problems": problems,
        "duration_s": round(elapsed, 1),
        "http_front": http,
        "calls": dict(ledger.calls),
        "tokens": ledger.tokens,
        "latency_ms": {k: _percentiles(v) for k, v in ledger.latency_ms.items()} | {"all": p},
        "failures": {f"{k} {c}": n for (k, c), n in sorted(ledger.failures.items())},
        "pinned": dict(ledger.pinned),
        "wrong": ledger.wrong[:20],
        "stale": ledger.stale[:20],
        "versions_referenced": len(ledger.refs),
        "trainer": dict(trainer.stats) | {"failed": dict(trainer.failed)},
        "push_seconds": _percentiles(trainer.push_seconds),
        "chaos": dict(chaos.stats) | {"down_s": _percentiles(chaos.down_s)},
        "resources": resources,
        "resource_curves": curves(samples),
        "server_exits": exits,
    }

"""The changing-weights soak's section of ``bench/RESULTS.md`` (``--results PATH``).

Written between :data:`BEGIN` and :data:`END` (replacing what is there; appended
otherwise); ``bench/run_all.py`` carries the section over when it rewrites the file.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

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

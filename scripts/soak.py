"""Soak test: mixed concurrent clients against a real megascore server for a long time.

The long version of ``tests/reliability/test_load.py``. Starts ``megascore serve`` on
the built-in tiny model (or uses ``--target``), scores a pool of random batches once
with a single client (the references), then runs sync unary, sync streaming and
asyncio clients for ``--duration`` seconds. Every answer must be bit-identical to its
reference. Every ``--report-every`` seconds it prints throughput, latency
percentiles, failures and the server's resident memory (launcher + ranks); at the
end a summary, and the exit code is 1 on any failure, mismatch, or RSS growth
above ``--max-rss-growth`` after the warm-up.

    .venv/bin/python scripts/soak.py                      # 10 min, TP=2, 6 clients
    .venv/bin/python scripts/soak.py --duration 3600 --nproc 2 --tp 2 --unary 4
    .venv/bin/python scripts/soak.py --target 10.0.0.5:50051 --duration 600  # no RSS

``--changing-weights`` runs the other soak (issue 36, :mod:`soak_weights`): a replica
set of ``tiny-moe`` servers whose weights a trainer loop pushes (full and delta) and
reloads while a chaos loop kills and restarts a replica, mixed clients (sync, asyncio,
stream, the JSONL CLI, the HTTP front when ``megascore serve`` has one) with and without
version pins; every answer checked bit for bit against a reference scoring at the
version it names; per-process RSS, fds and threads flat within 5 % after the warm-up.

    .venv/bin/python scripts/soak.py --changing-weights --duration 3600
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megascore_client import ScoringClient  # noqa: E402
from megascore_server.serve_process import CPU_ONE_THREAD, ServeProcess  # noqa: E402
from testkit.load import (  # noqa: E402
    KINDS,
    RssSampler,
    Stats,
    make_cases,
    reference_results,
    run_load,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--warmup", type=float, help="seconds before the resource baseline")
    parser.add_argument("--report-every", type=float, default=30.0, help="seconds per report")
    parser.add_argument("--unary", type=int, default=2, help="sync unary clients")
    parser.add_argument("--stream", type=int, default=2, help="sync streaming clients")
    parser.add_argument("--async", dest="async_", type=int, default=2, help="asyncio clients")
    parser.add_argument("--cases", type=int, help="distinct random batches (48; changing: 16)")
    parser.add_argument("--max-len", type=int, help="longest sequence (256; changing: 96)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the started server")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--target", help="use this running server instead of starting one")
    parser.add_argument("--max-rss-growth", type=float, default=0.10, help="fraction")
    parser.add_argument("--json", help="write the summary as JSON to this file")
    weights = parser.add_argument_group("--changing-weights (scripts/soak_weights.py)")
    weights.add_argument("--changing-weights", action="store_true", help="the issue-36 soak")
    weights.add_argument("--push-every", type=float, default=15.0, help="seconds per push")
    weights.add_argument("--load-every", type=int, default=7, help="every Nth step: a reload")
    weights.add_argument("--kill-every", type=float, default=120.0, help="seconds per kill")
    weights.add_argument("--http", type=int, default=1, help="HTTP clients (if served)")
    weights.add_argument("--no-http", action="store_true", help="no HTTP front, no HTTP clients")
    weights.add_argument("--think-ms", type=float, default=50.0, help="pause between calls")
    weights.add_argument("--sample-every", type=float, default=5.0, help="resource samples (s)")
    weights.add_argument("--window", type=float, default=60.0, help="seconds compared (resources)")
    weights.add_argument("--log-dir", help="server logs, resources.csv, summary.json")
    weights.add_argument("--results", help="write the run's section into this RESULTS.md")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    changing = args.changing_weights
    if args.warmup is None:
        args.warmup = max(30.0, args.duration / 10) if changing else 20.0
    if args.cases is None:
        args.cases = 16 if changing else 48
    if args.max_len is None:
        args.max_len = 96 if changing else 256
    return args


def fmt_latency(stats: Stats, kind: str | None = None) -> str:
    p = stats.percentiles(kind)
    return " ".join(f"{k}={v:.0f}ms" for k, v in p.items()) or "-"


def soak(args: argparse.Namespace, server: ServeProcess | None) -> dict:
    target = args.target or server.target
    rss = server.total_rss_kb if server is not None else None
    cases = make_cases(args.cases, seed=args.seed, max_len=args.max_len)
    print(f"soak: {target}, {len(cases)} batches, references ...", flush=True)
    with ScoringClient(target, timeout=300) as client:
        refs = reference_results(client, cases)
    clients = {"unary": args.unary, "stream": args.stream, "async": args.async_}

    warm = run_load(target, cases, refs, duration_s=args.warmup, clients=clients)
    baseline = rss() if rss else None
    print(
        f"soak: warm-up {warm.count} calls, {len(warm.failures)} failures; "
        f"RSS baseline {baseline} KiB",
        flush=True,
    )
    sampler = RssSampler(rss, interval_s=max(1.0, args.report_every / 6)) if rss else None
    total = Stats()
    start = time.monotonic()
    done = threading.Event()

    def report() -> None:  # one line per window, from the shared stats
        last_count, last_tokens, last_at = 0, 0, start
        while not done.wait(args.report_every):
            now = time.monotonic()
            count, tokens = total.count, total.tokens
            rate = (count - last_count) / (now - last_at)
            token_rate = (tokens - last_tokens) / (now - last_at)
            print(
                f"[{now - start:7.0f}s] {rate:6.1f} calls/s {token_rate:8.0f} tok/s  "
                f"{fmt_latency(total)}  failures={len(total.failures)} "
                f"mismatches={len(total.mismatches)}  rss={rss() if rss else '-'} KiB",
                flush=True,
            )
            last_count, last_tokens, last_at = count, tokens, now

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    run_load(target, cases, refs, duration_s=args.duration, clients=clients, stats=total)
    done.set()
    reporter.join(10)
    elapsed = time.monotonic() - start
    samples = sampler.stop() if sampler else []
    final = rss() if rss else None
    summary = {
        "target": target,
        "duration_s": elapsed,
        "calls": total.count,
        "tokens": total.tokens,
        "calls_per_s": total.count / elapsed,
        "tokens_per_s": total.tokens / elapsed,
        "latency_ms": {kind: total.percentiles(kind) for kind in KINDS}
        | {"all": total.percentiles()},
        "failures": len(total.failures),
        "mismatches": len(total.mismatches),
        "max_diff": total.max_diff,
        "rss_kib": {
            "baseline": baseline,
            "final": final,
            "peak": max((r for _, r in samples), default=None),
            "trend": samples[:: max(1, len(samples) // 20)],
        },
        "examples": (total.failures + total.mismatches)[:10],
    }
    return summary


def verdict(summary: dict, max_growth: float) -> list[str]:
    problems = []
    if summary["failures"]:
        problems.append(f"{summary['failures']} failed calls")
    if summary["mismatches"] or summary["max_diff"] != 0.0:
        problems.append(f"{summary['mismatches']} answers differ (max {summary['max_diff']})")
    rss = summary["rss_kib"]
    if rss["baseline"] and rss["final"] > rss["baseline"] * (1 + max_growth):
        problems.append(f"RSS grew {rss['baseline']} -> {rss['final']} KiB")
    if not summary["calls"]:
        problems.append("no call completed")
    return problems


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.changing_weights:
        from soak_weights import run_changing

        return run_changing(args)
    server = None
    if args.target is None:
        log = Path(tempfile.mkdtemp(prefix="megascore-soak-")) / "serve.log"
        flags = ["--model", args.model, "--nproc", str(args.nproc), "--grace-s", "30"]
        if args.tp > 1:
            flags += ["--tensor-model-parallel-size", str(args.tp)]
        print(f"soak: starting megascore serve {' '.join(flags)} (log {log})", flush=True)
        server = ServeProcess(log, *flags, env=CPU_ONE_THREAD)
    try:
        if server is not None:
            server.wait_serving()
        summary = soak(args, server)
        if server is not None:
            summary["server_exit_code"] = server.terminate(timeout=120)
            summary["leftover_pids"] = server.leftovers()
    finally:
        if server is not None:
            server.close()
    print(json.dumps(summary, indent=2, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str))
    problems = verdict(summary, args.max_rss_growth)
    if server is not None and summary["server_exit_code"] != 0:
        problems.append(f"server exited {summary['server_exit_code']}")
    if server is not None and summary["leftover_pids"]:
        problems.append(f"processes left behind: {summary['leftover_pids']}")
    print("soak: " + ("PASS" if not problems else "FAIL: " + "; ".join(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

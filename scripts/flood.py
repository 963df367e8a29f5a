"""Floods and slow clients against both fronts, with good clients measured through them.

Starts ``megascore serve --model tiny --device cpu --http-port P`` (or takes ``--target``
and ``--http-target``, and ``--pid`` for its ``/proc``), then runs ``--grpc-clients``
SDK clients (unary Score) and ``--http-clients`` HTTP clients (``POST /v1/completions``,
keep-alive), each calling in a loop for ``--measure-s`` seconds: first with no attack,
then under each attack in turn (``scripts/flood_attacks.py``, in a process of its own):
idle gRPC + HTTP connections, slowloris, ScoreStreams that never read, connection
churn, bodies at the size limits (sizes: the flags below). Each phase's good clients
open new connections, so a phase also shows that new clients are served under its
attack. After each attack the server's RSS and open fds (``/proc/PID``) are read once
they settle (up to ``--settle-s``).

Prints a markdown table (each attack: the good clients' calls, p50 / p99 against no
attack, failures, RSS / fds after against before, what the attack saw) and exits 1
when a bar is missed: a p99 above ``--max-p99-ratio`` times no attack's, a failed good
call, RSS or fds more than ``--max-growth`` above the baseline (taken after the
no-attack phase, every good client closed), an answer to the attack a server must never
give (a 5xx but 503, INTERNAL, UNKNOWN), an attack never established; for a started
server also a traceback in its log or an exit other than 0 on SIGTERM.

    .venv/bin/python scripts/flood.py                       # full size, a few minutes
    .venv/bin/python scripts/flood.py --measure-s 3 --idle-http 200 --churn-rate 200
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flood_attacks import ATTACKS, add_size_flags, size_argv  # noqa: E402

from megascore.model.config import builtin_model  # noqa: E402
from megascore_client import ScoringClient  # noqa: E402
from megascore_server import procfs  # noqa: E402
from megascore_server.connection_limits import raise_open_files_limit  # noqa: E402
from megascore_server.ports import pick_port  # noqa: E402
from megascore_server.serve_process import CPU_ONE_THREAD, ServeProcess  # noqa: E402

PHASES = ("none", *ATTACKS)
BATCH = 4
"""Sequences per good call (of 32 tokens)."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="gRPC address of a running tiny server")
    parser.add_argument("--http-target", help="HOST:PORT of that server's HTTP front")
    parser.add_argument("--pid", type=int, help="pid of that server (its RSS and fds)")
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated subset")
    parser.add_argument("--grpc-clients", type=int, default=2, help="good SDK clients")
    parser.add_argument("--http-clients", type=int, default=2, help="good HTTP clients")
    parser.add_argument("--measure-s", type=float, default=30.0, help="seconds per phase")
    parser.add_argument("--settle-s", type=float, default=30.0, help="longest wait after one")
    parser.add_argument("--header-timeout-s", type=float, help="the started server's")
    parser.add_argument("--max-p99-ratio", type=float, default=3.0)
    parser.add_argument("--max-growth", type=float, default=0.05, help="RSS / fds, a fraction")
    parser.add_argument("--json", help="write the summary as JSON to this file")
    add_size_flags(parser)
    args = parser.parse_args(argv)
    if (args.target is None) != (args.http_target is None):
        parser.error("--target and --http-target go together")
    unknown = set(args.attacks.split(",")) - set(ATTACKS)
    if unknown:
        parser.error(f"unknown attacks {sorted(unknown)}; known: {', '.join(ATTACKS)}")
    return args


# ------------------------------------------------------------------------ good clients


class GoodClients:
    """The measured clients: each calls in a loop on connections of its own per phase."""

    def __init__(self, args: argparse.Namespace, target: str, http_target: str):
        self.args, self.target = args, target
        self.http_host, _, port = http_target.rpartition(":")
        self.http_port = int(port)
        rng = np.random.default_rng(0)
        vocab = builtin_model("tiny").vocab_size
        self.batch = [rng.integers(0, vocab, 32).tolist() for _ in range(BATCH)]
        self.body = json.dumps(
            {"prompt": self.batch, "max_tokens": 0, "echo": True, "logprobs": 1}
        ).encode()

    def _grpc(self, until: float, latencies: list, failures: list) -> None:
        with ScoringClient(self.target, timeout=30) as client:
            while time.monotonic() < until:
                start = time.perf_counter()
                try:
                    result = client.score(self.batch)
                    assert len(result.logprobs) == BATCH, "wrong number of sequences"
                except Exception as exc:  # noqa: BLE001 - every failure is counted
                    failures.append(f"grpc: {exc!r}"[:300])
                    continue
                latencies.append((time.perf_counter() - start) * 1000)

    def _http(self, until: float, latencies: list, failures: list) -> None:
        conn = http.client.HTTPConnection(self.http_host, self.http_port, timeout=30)
        headers = {"Content-Type": "application/json"}
        try:
            while time.monotonic() < until:
                start = time.perf_counter()
                try:
                    conn.request("POST", "/v1/completions", body=self.body, headers=headers)
                    response = conn.getresponse()
                    data = response.read()
                    assert response.status == 200, f"{response.status} {data[:200]!r}"
                    assert len(json.loads(data)["choices"]) == BATCH, "wrong number of choices"
                except Exception as exc:  # noqa: BLE001 - every failure is counted
                    failures.append(f"http: {exc!r}"[:300])
                    conn.close()  # reconnects on the next request
                    continue
                latencies.append((time.perf_counter() - start) * 1000)
        finally:
            conn.close()

    def run(self) -> dict:
        """Every good client for ``--measure-s`` seconds: calls, p50, p99, failures."""
        latencies: list[float] = []
        failures: list[str] = []
        until = time.monotonic() + self.args.measure_s
        kinds = [self._grpc] * self.args.grpc_clients + [self._http] * self.args.http_clients
        threads = [threading.Thread(target=k, args=(until, latencies, failures)) for k in kinds]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        p50, p99 = np.percentile(latencies, [50, 99]) if latencies else (np.nan, np.nan)
        return {
            "calls": len(latencies),
            "p50_ms": round(float(p50), 1),
            "p99_ms": round(float(p99), 1),
            "failures": len(failures),
            "failure_examples": failures[:5],
        }


# ----------------------------------------------------------------------------- phases


def start_attack(args, name: str, target: str, http_target: str) -> subprocess.Popen:
    """The attack's process, once it printed ``ready`` (raises when it never does)."""
    command = [sys.executable, str(Path(__file__).with_name("flood_attacks.py")), name]
    command += ["--http", http_target, "--grpc", target, *size_argv(args)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    ready = threading.Event()
    threading.Thread(target=lambda: proc.stdout.readline() and ready.set(), daemon=True).start()
    if not ready.wait(args.ready_timeout_s + 40):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"attack {name} never established")
    return proc


def stop_attack(proc: subprocess.Popen) -> dict:
    """SIGTERM to the attack; its summary line."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"counts": {}, "problems": [f"the attack exited {proc.returncode}"]}
    return json.loads(lines[-1])


def settled(pid: int | None, base: procfs.Usage | None, args) -> procfs.Usage | None:
    """The server's usage once RSS and fds are back within ``--max-growth`` of ``base``
    (or ``--settle-s`` passed); None without a pid."""
    if pid is None:
        return None
    end = time.monotonic() + args.settle_s
    while True:
        time.sleep(0.5)
        now = procfs.usage(pid)
        if base is None or now is None or time.monotonic() >= end:
            return now
        if now.fds <= base.fds * (1 + args.max_growth) and now.rss_kib <= base.rss_kib * (
            1 + args.max_growth
        ):
            return now


def run_phases(args, target: str, http_target: str, pid: int | None) -> list[dict]:
    good = GoodClients(args, target, http_target)
    rows, base = [], None
    for name in ("none", *args.attacks.split(",")):
        print(f"flood: phase {name}", flush=True)
        attack = None if name == "none" else start_attack(args, name, target, http_target)
        row = {"attack": name, **good.run()}
        row.update(stop_attack(attack) if attack else {"counts": {}, "problems": []})
        usage = settled(pid, base, args)
        if base is None:
            base = usage
        row.update(rss_mib=usage and round(usage.rss_kib / 1024, 1), fds=usage and usage.fds)
        rows.append(row)
        print(f"flood: {json.dumps(row)}", flush=True)
    return rows


# ----------------------------------------------------------------------------- verdict


def size_of(name: str, args) -> str:
    return {
        "none": "",
        "idle": f"{args.idle_http} HTTP + {args.idle_grpc} gRPC",
        "slowloris": f"{args.slowloris} HTTP + {args.slowloris_grpc} gRPC, 1 B/{args.trickle_s:g}s",
        "unread": f"{args.unread} streams",
        "churn": f"{args.churn_rate} / s",
        "bodies": f"{args.body_clients} clients, {args.max_body_bytes / (1 << 20):g} MiB",
    }[name]


def judge(rows: list[dict], args) -> list[str]:
    """The bars each row misses."""
    alone, problems = rows[0], []
    for row in rows:
        name = row["attack"]
        ratio = row["p99_ms"] / alone["p99_ms"]
        row["p99_ratio"] = round(ratio, 2)
        if not ratio <= args.max_p99_ratio:
            problems.append(f"{name}: p99 {row['p99_ms']} ms is {ratio:.2f}x no attack's")
        if row["failures"]:
            problems.append(f"{name}: {row['failures']} failed calls {row['failure_examples']}")
        problems += [f"{name}: attack answered {p}" for p in row["problems"]]
        for key in ("rss_mib", "fds"):
            if row[key] is None:
                continue
            row[f"{key}_growth"] = round(row[key] / alone[key] - 1, 3)
            if row[f"{key}_growth"] > args.max_growth:
                problems.append(f"{name}: {key} {row[key]} vs {alone[key]} before")
    return problems


def _attack_saw(row: dict) -> str:
    counts = row["counts"]
    closed = sum(v for k, v in counts.items() if k.endswith("closed by server"))
    opened = sum(v for k, v in counts.items() if k.endswith(("opened", "dropped")))
    parts = {
        "idle": f"{opened} opened, {closed} closed by the server",
        "slowloris": f"{opened} opened, {closed} closed by the server",
        "unread": f"{counts.get('unread stream writes', 0)} requests written",
        "churn": f"{opened} in {counts.get('churn seconds', 0)} s",
        "bodies": f"{sum(counts.values())} bodies answered",
    }
    return parts.get(row["attack"], "")


def table(rows: list[dict], args) -> str:
    lines = [
        "| attack | size | good calls | p50 ms | p99 ms | p99 / alone | failures "
        "| RSS MiB after | fds after | the attack saw |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        rss = "n/a" if row["rss_mib"] is None else f"{row['rss_mib']:,}"
        fds = "n/a" if row["fds"] is None else str(row["fds"])
        if row["attack"] != "none" and row["fds"] is not None:
            rss += f" ({row['rss_mib_growth']:+.1%})"
            fds += f" ({row['fds_growth']:+.1%})"
        lines.append(
            f"| {row['attack']} | {size_of(row['attack'], args)} | {row['calls']:,} "
            f"| {row['p50_ms']} | {row['p99_ms']} | {row['p99_ratio']:.2f} | {row['failures']} "
            f"| {rss} | {fds} | {_attack_saw(row)} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    raise_open_files_limit()  # thousands of connections on this side too
    server, target, http_target, pid = None, args.target, args.http_target, args.pid
    if target is None:
        log = Path(tempfile.mkdtemp(prefix="megascore-flood-")) / "serve.log"
        http_port = pick_port()
        flags = ["--model", "tiny", "--device", "cpu", "--http-port", str(http_port)]
        flags += ["--max-message-bytes", str(args.max_body_bytes)]
        if args.header_timeout_s is not None:
            flags += ["--header-timeout-s", str(args.header_timeout_s)]
        print(f"flood: starting megascore serve {' '.join(flags)} (log {log})", flush=True)
        server = ServeProcess(log, *flags, env=CPU_ONE_THREAD)
        target, http_target, pid = server.target, f"127.0.0.1:{http_port}", server.pid
    problems, exit_code = [], None
    try:
        if server is not None:
            server.wait_serving()
        rows = run_phases(args, target, http_target, pid)
        problems += judge(rows, args)
        if server is not None:
            exit_code, ended = server.end_cleanly()
            problems += ended
    finally:
        if server is not None:
            server.close()
    print(table(rows, args))
    if args.json:
        summary = {"rows": rows, "problems": problems, "server_exit_code": exit_code}
        Path(args.json).write_text(json.dumps(summary, indent=2))
    for problem in problems:
        print(f"flood: {problem}")
    print(f"flood: {'PASS' if not problems else f'FAIL: {len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

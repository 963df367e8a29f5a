"""The GPU check of megascore (run through ``scripts/gpu_check.sh``), inside one deadline.

Every row runs in a subprocess of its own, in order, and the run has one deadline
(``--deadline-s``, default 480 s, counted from the start of ``gpu_check.sh``, the kit
install included). Each row has a planned share; its window ends where the plan's
shares up to it end, so a row gets its share plus what the rows before it left
unused, and never runs past the deadline: at its window's end it gets SIGTERM, then
SIGKILL after ``GRACE_S``. Each row is written as it finishes: a line on stdout, one JSON
line in ``OUT/gpu_check.jsonl`` and the table so far in ``OUT/gpu_check.md`` (``OUT``:
``--out``, else ``$OUT``, else a temporary directory), so a run killed from outside
keeps every finished row.

``--rows a,b`` picks rows (``--rows all``: every row, default and extra);
``--dry-run`` prints the plan of the chosen rows with the deadline arithmetic and
ends with ``gpu_check: planned S s of D s`` (S: the last window's end, the planned
worst case). Without CUDA (``--device auto``) every GPU row is SKIP "no CUDA" and the
exit status 0; ``--device cpu`` runs the rows on the CPU (small shapes, float32, the
8B rows say why not). The rows: ``ROWS`` below, the default ones first, in their
order: parity, then performance, then the single-GPU rows of docs/deploy.md,
"Checking a GPU host". The table: ``| check | result | seconds | detail |`` with
PASS / FAIL / SKIP / WARN / INFO, then ``gpu_check: N pass, N fail, N skip, N warn``;
exit status 1 when a row failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 480.0  # 8 minutes: one device command is at most 10
INSTALL_S = 50.0  # planned kit install (measured 34 s offline, docs/deploy.md)
GRACE_S = 5.0  # SIGTERM -> SIGKILL at a window's end (a row's servers stop in it)
NO_CUDA = "no CUDA"
RESULTS = ("PASS", "FAIL", "SKIP", "WARN")


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the check: ``target`` (``module:function`` of scripts/) is called in a
    subprocess with a :class:`RowContext`; ``seconds`` is its planned worst case on one
    H100 (its share of the deadline)."""

    key: str
    check: str
    seconds: float
    target: str
    default: bool = True


ROWS = (
    Row("versions", "versions", 15, "gpu_check_rows:versions"),
    Row("parity", "parity: llama 128k vocab, 6 packed sequences", 40, "gpu_check_single:parity"),
    Row("startup-8b", "start-up bench-8b", 70, "gpu_check_rows:startup"),
    Row("host-syncs", "host syncs per layer", 25, "gpu_check_rows:host_syncs"),
    Row("mfu", "tokens/s and MFU bench", 20, "gpu_check_rows:throughput_bench"),
    Row("mfu-8b", "tokens/s and MFU bench-8b", 45, "gpu_check_rows:throughput_8b"),
    Row("prefix-8b", "prefix sharing vs dense bench-8b", 50, "gpu_check_rows:prefix_8b"),
    Row("mla", "MLA (q_lora_rank null and set)", 25, "gpu_check_single:mla"),
    Row("fp8", "FP8 block dequantisation", 20, "gpu_check_single:fp8"),
    Row("top-k", "top-256 over a 128k vocabulary", 20, "gpu_check_single:top_k"),
    Row("lm-head", "bf16 LM head vs fp32", 20, "gpu_check_single:lm_head"),
    Row("attention-lse", "attention_with_lse with a bias", 15, "gpu_check_single:attention_lse"),
    Row("memory", "memory over 500 steps", 35, "gpu_check_single:memory"),
    Row("prefix", "prefix sharing vs dense bench", 45, "gpu_check_rows:prefix_bench", False),
    Row(
        "prefix-cache", "prefix cache vs none bench", 45, "gpu_check_rows:prefix_cache_bench", False
    ),
    Row("tests-gpu", "tests/gpu", 240, "gpu_check_serve:gpu_tests", False),
    Row("serve", "serve (CLI)", 90, "gpu_check_serve:serve_cli", False),
    Row("serve-cpu", "serve --device cpu on the CUDA host", 90, "gpu_check_serve:serve_cpu", False),
    Row("sdk", "routing replay and bf16 push (SDK)", 120, "gpu_check_serve:sdk_rows", False),
    Row("round-trip", "checkpoint round trip", 240, "gpu_check_serve:round_trip", False),
)


def pick(spec: str | None) -> list[Row]:
    """The rows of ``--rows`` (comma-separated keys, in the given order; "all"; None:
    the default rows)."""
    if spec is None:
        return [row for row in ROWS if row.default]
    if spec == "all":
        return list(ROWS)
    by_key = {row.key: row for row in ROWS}
    unknown = [key for key in spec.split(",") if key not in by_key]
    if unknown:
        raise SystemExit(f"gpu_check: unknown rows {unknown}; rows: {', '.join(by_key)}")
    return [by_key[key] for key in spec.split(",")]


def plan(rows: list[Row], install_s: float) -> list[tuple[Row, float]]:
    """Each row with the end of its window: the kit install's share, then the rows'
    shares in order (seconds from the start of gpu_check.sh)."""
    end, windows = install_s, []
    for row in rows:
        end += row.seconds
        windows.append((row, end))
    return windows


def print_plan(rows: list[Row], install_s: float, deadline_s: float) -> float:
    """The dry run: each row's share and window; returns the planned total."""
    print(f"gpu_check plan: deadline {deadline_s:.0f} s from the start of gpu_check.sh")
    print(
        f"  kit install (gpu_check.sh, when needed)  share {install_s:.0f} s, ends {install_s:.0f}"
    )
    windows = plan(rows, install_s)
    for row, end in windows:
        cut = "" if end <= deadline_s else f" (past the deadline: cut at {deadline_s:.0f})"
        print(f"  {row.key:14} {row.check:45} share {row.seconds:.0f} s, ends {end:.0f}{cut}")
    total = windows[-1][1] if windows else install_s
    print(
        f"  a row may run until its window ends (its share and what earlier rows left), "
        f"then SIGTERM, SIGKILL {GRACE_S:.0f} s later; none past {deadline_s:.0f} s"
    )
    print(f"gpu_check: planned {total:.0f} s of {deadline_s:.0f} s")
    return total


class Table:
    """Rows as they finish: stdout, ``OUT/gpu_check.jsonl`` and ``OUT/gpu_check.md``."""

    def __init__(self, out: Path):
        self.out = out
        self.rows: list[tuple[str, str, float, str]] = []

    def add(self, check: str, result: str, seconds: float = 0.0, detail: str = "") -> None:
        detail = " ".join(str(detail).split())[:240].replace("|", "/")
        self.rows.append((check, result, seconds, detail))
        with open(self.out / "gpu_check.jsonl", "a") as f:
            f.write(json.dumps({"row": [check, result, seconds, detail]}) + "\n")
        (self.out / "gpu_check.md").write_text("\n".join(self.lines()) + "\n")
        print(f"gpu_check row: | {check} | {result} | {seconds:.1f} | {detail} |", flush=True)

    def lines(self) -> list[str]:
        lines = ["| check | result | seconds | detail |", "|---|---|---|---|"]
        return lines + [f"| {c} | {r} | {s:.1f} | {d} |" for c, r, s, d in self.rows]

    def print(self) -> int:
        print("\n".join(self.lines()))
        counts = {r: sum(1 for row in self.rows if row[1] == r) for r in RESULTS}
        print("gpu_check: " + ", ".join(f"{counts[r]} {r.lower()}" for r in RESULTS))
        return 1 if counts["FAIL"] else 0


def worker_command(row: Row, device: str, out: Path, seconds: float) -> list[str]:
    """The subprocess that runs ``row``."""
    cmd = [sys.executable, str(Path(__file__)), "--row", row.key, "--device", device]
    return cmd + ["--out", str(out), "--seconds", f"{seconds:.1f}"]


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM to the row's process group, SIGKILL after ``GRACE_S``; its output so far."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.communicate(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            continue
    return proc.communicate()


def run_row(table: Table, row: Row, command: list[str], window_s: float) -> None:
    """Runs one row's subprocess for at most ``window_s`` seconds; adds its rows."""
    start = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=max(window_s - GRACE_S, 0.1))
        killed = False
    except subprocess.TimeoutExpired:
        stdout, stderr = _stop(proc)
        killed = True
    seconds = time.monotonic() - start
    rows = [json.loads(line)["row"] for line in stdout.splitlines() if line.startswith('{"row"')]
    for check, result, row_s, detail in rows:
        table.add(check, result, row_s, detail)
    tail = " / ".join((stderr or "").strip().splitlines()[-3:])
    if killed:
        table.add(row.check, "FAIL", seconds, f"stopped at its window's end ({window_s:.0f} s)")
    elif proc.returncode != 0 or not rows:
        table.add(row.check, "FAIL", seconds, f"exit {proc.returncode}: {tail}")


def run(rows, device: str, out: Path, started: float, deadline_s: float, install_s: float):
    """Runs ``rows`` in their windows (``started``: time.time() at gpu_check.sh's start)."""
    table = Table(out)
    for row, end in plan(rows, install_s):
        window = min(end, deadline_s) - (time.time() - started)
        if window < 2 * GRACE_S:
            table.add(row.check, "SKIP", detail=f"deadline: {window:.0f} s left of its window")
            continue
        run_row(table, row, worker_command(row, device, out, window), window)
    return table


@dataclasses.dataclass
class RowContext:
    """What a row function gets: the device, its dtype, a directory, its seconds."""

    device: str
    out: Path
    seconds: float

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.device == "cuda" else "float32"

    def emit(self, check: str, result: str, seconds: float, detail: str) -> None:
        print(json.dumps({"row": [check, result, seconds, detail]}), flush=True)


def row_worker(row: Row, ctx: RowContext) -> int:
    """Body of a row's subprocess: the row function's rows as JSON lines on stdout."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # servers stop in ``with``
    sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]  # the row modules, testkit
    module, _, name = row.target.partition(":")
    start = time.monotonic()
    try:
        result = getattr(importlib.import_module(module), name)(ctx)
    except Exception as e:  # noqa: BLE001 - a failing row is a row
        result = "FAIL", f"{type(e).__name__}: {e}"
    if result is not None:
        ctx.emit(row.check, result[0], time.monotonic() - start, result[1])
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument(
        "--out", default=os.environ.get("OUT"), help="default: $OUT, else a temp dir"
    )
    parser.add_argument(
        "--rows", help="comma-separated row keys, or 'all' (default: the default rows)"
    )
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S)
    parser.add_argument("--started", type=float, help="time.time() at gpu_check.sh's start")
    parser.add_argument("--install-s", type=float, default=INSTALL_S, help="the install's share")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows = pick(args.rows)
    if args.dry_run:
        print_plan(rows, args.install_s, args.deadline_s)
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    if args.row:
        return row_worker(pick(args.row)[0], RowContext(args.device, out, args.seconds))
    started = args.started or time.time()
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "none"
    if device == "none":  # the versions row, every other row SKIP
        table = run(pick("versions"), "cpu", out, started, args.deadline_s, args.install_s)
        for row in rows:
            if row.key != "versions":
                table.add(row.check, "SKIP", detail=NO_CUDA)
        return table.print()
    return run(rows, device, out, started, args.deadline_s, args.install_s).print()


if __name__ == "__main__":
    sys.exit(main())

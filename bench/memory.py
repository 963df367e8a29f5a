"""Peak memory vs tokens per batch, each size in a fresh process (logprobs and top-5 on).

Every size runs in its own ``python bench/memory.py child`` process: build the
engine, score a 16-token warm-up batch, reset the peak, score one batch of
``N`` tokens (sequences of ``--seq-len`` tokens), report the peak. On the CPU
the peak is the process's peak RSS (``VmHWM`` after a reset through
``/proc/self/clear_refs``, with a fixed glibc mmap threshold so freed buffers go
back to the OS; ``common.PeakMemory``); on a GPU it is
``torch.cuda.max_memory_allocated``. The parent fits ``peak = a * N + b`` by
least squares and reports R^2 and the largest residual: growth must be linear
(no point further from the line than 5 % of the largest growth in a step). The
logits exist ``logprob_chunk_tokens`` rows at a time, so above that many tokens
only the activations grow; a ``tokens x tokens`` mask or a ``[tokens, vocab]``
working set would bend the line upwards.

Usage: ``python bench/memory.py [--device cpu|cuda] [--sizes 8192,16384,24576,32768]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

SEQ_LEN = 256
RESIDUAL_TARGET = 0.05
"""Linear when no point is further from the least-squares line than 5 % of the largest
growth in a step (R^2 is reported too; it says little when the slope is near zero)."""


def child(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="memory.py child")
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="bench")
    args = p.parse_args(argv)
    import common
    import torch

    common.quiet_logs()
    engine = common.create_engine(args.device, args.model)
    try:
        device = torch.device(args.device)
        rng = np.random.default_rng(args.tokens)
        vocab = engine.info().vocab_size
        engine.score(common.score_batch([rng.integers(0, vocab, 16)]))
        n = max(1, args.tokens // args.seq_len)
        seqs = [rng.integers(0, vocab, args.tokens // n) for _ in range(n)]
        mem = common.PeakMemory(device)
        mem.start()
        engine.score(common.score_batch(seqs))
        growth = mem.stop()
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = mem._status_kib("VmHWM") * 1024
        print(json.dumps({"tokens": n * (args.tokens // n), "peak": peak, "growth": growth}))
    finally:
        engine.shutdown()


def run_size(tokens: int, device: str, seq_len: int, timeout: float, model: str) -> dict:
    from e2e_vs_engine import subprocess_env

    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "child",
        "--tokens",
        str(tokens),
        "--seq-len",
        str(seq_len),
        "--device",
        device,
        "--model",
        model,
    ]
    proc = subprocess.run(
        cmd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory child ({tokens} tokens) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def sweep(
    sizes: list[int],
    device: str,
    *,
    seq_len: int = SEQ_LEN,
    jobs: int = 1,
    timeout: float = 1800.0,
    model: str = "bench",
) -> dict:
    """Runs every size in a fresh process (``jobs`` at a time) and fits a line.

    Returns:
        ``{"points": [{"tokens", "peak", "growth"}], "slope", "intercept", "r2",
        "max_residual", "max_residual_frac"}`` (bytes; fit of the absolute peak).
    """
    import common

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        points = list(pool.map(lambda n: run_size(n, device, seq_len, timeout, model), sizes))
    x = np.array([pt["tokens"] for pt in points], dtype=float)
    y = np.array([pt["peak"] for pt in points], dtype=float)
    growth = np.array([pt["growth"] for pt in points], dtype=float)
    slope, intercept, r2 = common.linear_fit(x, y)
    residuals = y - (slope * x + intercept)
    worst = int(np.argmax(np.abs(residuals)))
    g_slope, g_intercept, g_r2 = common.linear_fit(x, growth)
    return {
        "points": points,
        "slope": slope,
        "intercept": intercept,
        "r2": r2,
        "max_residual": float(residuals[worst]),
        "max_residual_frac": float(abs(residuals[worst]) / max(growth.max(), 1.0)),
        "growth_slope": g_slope,
        "growth_intercept": g_intercept,
        "growth_r2": g_r2,
        "seq_len": seq_len,
    }


def explain(res: dict) -> str:
    """Residual per size: where the peak departs from the line."""
    rows = []
    for pt in res["points"]:
        fit = res["slope"] * pt["tokens"] + res["intercept"]
        rows.append(f"{pt['tokens']} tokens: {(pt['peak'] - fit) / 2**20:+.1f} MiB")
    return (
        f"R^2 {res['r2']:.4f}; residuals from the line: {'; '.join(rows)}. A growing "
        f"positive residual at the largest size means super-linear growth (a working set "
        f"quadratic in the tokens); scattered residuals mean allocator noise."
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--sizes", default="8192,16384,24576,32768")
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--jobs", type=int, default=1)
    args = p.parse_args()
    res = sweep(
        [int(s) for s in args.sizes.split(",")], args.device, seq_len=args.seq_len, jobs=args.jobs
    )
    for pt in res["points"]:
        print(
            f"{pt['tokens']:>8} tokens: peak {pt['peak'] / 2**20:9.1f} MiB "
            f"(+{pt['growth'] / 2**20:.1f} MiB in the step)"
        )
    print(
        f"fit: {res['slope'] / 1024:.1f} KiB/token + {res['intercept'] / 2**20:.1f} MiB, "
        f"R^2 {res['r2']:.4f}, max residual {res['max_residual'] / 2**20:+.1f} MiB"
    )


if __name__ == "__main__":
    main()

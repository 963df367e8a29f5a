"""Cost of each scoring option against a logprobs-only step (issue 22).

The in-process engine of one rank (the ``bench`` built-in: 12 layers, hidden 640,
vocabulary 32000) scores the same batch with one option at a time: top-5, top-256,
entropy, 256 caller-chosen target ids per token, rollout logprobs (mismatch statistics
and truncated importance weights). Every option is computed in the same vocab-parallel
chunked pass as the logprobs (or, for the mismatch, from them on the output rank).
Cost = CPU seconds of this process per step (on a shared machine wall time swings,
CPU time barely), the median over interleaved repetitions; the ratio is
``cost(option) / cost(logprobs only) - 1``. Target (issue 22): top-256 within 0.15.

Usage: ``python bench/option_cost.py [--tokens N] [--reps R] [--output bench/RESULTS.md]``
writes (or replaces) the section between the ``option_cost.py`` markers of RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from pathlib import Path

import common
import numpy as np

HERE = Path(__file__).parent
BEGIN, END = "<!-- option_cost.py: begin -->", "<!-- option_cost.py: end -->"
TARGET_TOP_256 = 0.15


def _options(batch_tokens: int, vocab: int, rng) -> dict[str, dict]:
    rollout = rng.normal(-3.0, 1.0, batch_tokens)
    return {
        "logprobs only": {},
        "top_k=5": {"top_k": 5},
        "top_k=256": {"top_k": 256},
        "return_entropy": {"return_entropy": True},
        "target_ids K=256": {"target_ids": rng.integers(0, vocab, (batch_tokens, 256))},
        "rollout_logprobs (+ importance weights)": {
            "rollout_logprobs": rollout,
            "return_importance_weights": True,
        },
    }


def measure(engine, lengths: list[int], reps: int, seed: int = 0) -> dict[str, float]:
    """Median CPU seconds per step of every option (interleaved repetitions)."""
    from megascore.api.types import ScoreBatch

    rng = np.random.default_rng(seed)
    vocab = engine.info().vocab_size
    ids = rng.integers(0, vocab, sum(lengths))
    options = _options(ids.size, vocab, rng)

    def step(kw: dict) -> float:
        batch = ScoreBatch(token_ids=ids, lengths=np.array(lengths), losses=("nll",), **kw)
        start = time.process_time()
        engine.score(batch)
        return time.process_time() - start

    for kw in options.values():  # warm-up
        step(kw)
    runs: dict[str, list[float]] = {name: [] for name in options}
    for _ in range(reps):
        for name, kw in options.items():
            runs[name].append(step(kw))
    return {name: statistics.median(values) for name, values in runs.items()}


def section(costs: dict[str, float], lengths: list[int], reps: int, minutes: float) -> str:
    base = costs["logprobs only"]
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()
    rows = []
    for name, cost in costs.items():
        ratio = cost / base - 1
        target = f"<= {TARGET_TOP_256}" if name == "top_k=256" else ""
        verdict = ("pass" if ratio <= TARGET_TOP_256 else "fail") if target else ""
        rows.append(f"| {name} | {cost:.3f} | {ratio:+.3f} | {target} | {verdict} |")
    return "\n".join(
        [
            BEGIN,
            "## Cost of each scoring option vs logprobs only",
            "",
            f"Written by `python bench/option_cost.py --reps {reps}` in {minutes:.1f} min "
            f"({when}, load average {load[0]:.1f} at the end); rerun it to update this section.",
            "",
            f"* model `{common.MODEL}` (CPU, float32, vocabulary 32000), in-process engine, "
            f"one step of {len(lengths)} sequences, {sum(lengths)} tokens, losses `nll`; "
            f"CPU seconds per step, median of {reps} interleaved repetitions",
            "",
            "| options | CPU s / step | vs logprobs only | target | result |",
            "|---|---:|---:|---|---|",
            *rows,
            "",
            "Every option rides the logprobs' chunked vocab-parallel pass (memory ~ chunk x "
            "vocab/TP); the mismatch statistics are numpy on the output rank.",
            END,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    args = parser.parse_args()
    common.quiet_logs()
    start = time.monotonic()
    engine = common.create_engine("cpu")
    try:
        lengths = [args.tokens // 4] * 4
        costs = measure(engine, lengths, args.reps)
    finally:
        engine.shutdown()
    text = section(costs, lengths, args.reps, (time.monotonic() - start) / 60)
    print(text)
    common.write_section(args.output, BEGIN, END, text)


if __name__ == "__main__":
    main()

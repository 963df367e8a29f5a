"""Cost of batch invariance: the bench model with and without ``batch_invariant``.

In-process engines of the ``bench`` model (CPU, float32, same seed, so the same
weights), with and without the option, score the rollout mix in token-budget steps
(logprobs, top-5 and the summed NLL, as the other benchmarks), the order of the two
alternating per repetition. The cost is ``CPU seconds with / CPU seconds without - 1``
per repetition, median (CPU time of this process: on a shared machine wall time swings
by tens of percent between passes, CPU time barely). Target <= 0.10 (issue 24); above
0.05 it would be an opt-in flag, below it is the CPU default.

The run also shows what the option buys: sequences of 1-3 tokens (where the CPU BLAS
takes its matrix-vector path when a sequence is alone) scored alone and inside a step
with others: with the option none differs, without it the count that do.

Usage: ``python bench/batch_invariance.py [--sequences N] [--reps R] [--output FILE]``
writes (or replaces) the section between the ``batch_invariance.py`` markers of
RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import common
import numpy as np

HERE = Path(__file__).parent
MODEL = "bench"
MAX_TOKENS = 8192
TARGET = 0.10
BEGIN, END = "<!-- batch_invariance.py: begin -->", "<!-- batch_invariance.py: end -->"


def create(batch_invariant: bool):
    common.single_rank_env()
    from megascore.config import EngineConfig
    from megascore.engine.runtime import DistributedEngine

    return DistributedEngine.create(
        EngineConfig(model=MODEL, device="cpu", batch_invariant=batch_invariant, prefix_cache=False)
    )


def differing_alone(engine, workload: common.Workload) -> tuple[int, int]:
    """Short sequences (1-3 tokens: the BLAS's matrix-vector path when alone) scored alone
    and inside one step with 4 sequences of the mix; returns (differing, probes)."""
    probes = [seq[: 1 + i % 3] for i, seq in enumerate(workload.sequences[:12])]
    step = [*workload.sequences[:4], *probes]
    packed = engine.score(common.score_batch(step)).logprobs
    packed = np.split(packed, np.cumsum([len(s) for s in step])[:-1])[4:]
    alone = [engine.score(common.score_batch([p])).logprobs for p in probes]
    return sum(not np.array_equal(a, b) for a, b in zip(alone, packed, strict=True)), len(probes)


def measure(num_sequences: int, reps: int, seed: int) -> dict:
    """One engine at a time (Megatron's parallel state is per process): each pass builds
    its engine (not timed), warms it up, scores the mix; the last pass of each kind also
    scores every sequence alone."""
    cpu = {True: [], False: []}
    wall = {True: [], False: []}
    last, differ, rollout = {}, {}, None
    for rep in range(reps):
        for on in (True, False) if rep % 2 == 0 else (False, True):
            engine = create(on)
            try:
                if rollout is None:
                    vocab = engine.info().vocab_size
                    rollout, _ = common.make_workloads(num_sequences, seed, vocab)
                engine.score(common.score_batch(common.warmup_sequences(rollout)))
                result = common.engine_pass(engine, rollout, MAX_TOKENS)
                cpu[on].append(result.cpu_seconds)
                wall[on].append(result.seconds)
                last[on] = result.logprobs
                if rep >= reps - 2 and on not in differ:
                    differ[on] = differing_alone(engine, rollout)
            finally:
                engine.shutdown()
    ratios = [a / b - 1 for a, b in zip(cpu[True], cpu[False], strict=True)]
    max_diff = max(float(np.abs(a - b).max()) for a, b in zip(last[True], last[False], strict=True))
    return {
        "workload": rollout,
        "cost": statistics.median(ratios),
        "ratios": ratios,
        "cpu_on": statistics.median(cpu[True]),
        "cpu_off": statistics.median(cpu[False]),
        "wall_on": statistics.median(wall[True]),
        "wall_off": statistics.median(wall[False]),
        "differ": differ,
        "max_diff": max_diff,
    }


def section(res: dict, reps: int, elapsed: float, load: str) -> str:
    w = res["workload"]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cost = res["cost"]
    on, off = res["differ"][True], res["differ"][False]
    return "\n".join(
        [
            BEGIN,
            "## Batch invariance (`batch_invariant`, CPU default)",
            "",
            f"Written by `python bench/batch_invariance.py --reps {reps}` in "
            f"{elapsed / 60:.1f} min ({now}, load average {load}); rerun it to update this "
            "section.",
            "",
            f"* model `{MODEL}` (CPU, float32), in-process engines (same weights), "
            f"workload `rollout`: {w.summary()}; steps of <= {MAX_TOKENS} tokens, logprobs + "
            f"top-5 + NLL; order alternating, {reps} repetitions, median",
            "",
            "| measurement | value | target | result | measured |",
            "|---|---:|---|---|---|",
            f"| CPU time with / without - 1 | {cost:+.4f} | <= {TARGET} | "
            f"{'pass' if cost <= TARGET else 'MISS'} | {res['cpu_on']:.2f} s / "
            f"{res['cpu_off']:.2f} s CPU (reps {min(res['ratios']):+.4f}.."
            f"{max(res['ratios']):+.4f}); wall {res['wall_on']:.2f} s / "
            f"{res['wall_off']:.2f} s |",
            f"| short sequences (1-3 tokens) whose logprobs alone != in a step | with: "
            f"{on[0]} of {on[1]}, without: {off[0]} of {off[1]} | 0 with | "
            f"{'pass' if on[0] == 0 else 'MISS'} | mix logprobs with vs without: max abs "
            f"diff {res['max_diff']:.1e} |",
            END,
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, default=48)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args()
    common.quiet_logs()
    start = time.time()
    res = measure(args.sequences, args.reps, args.seed)
    load = common.load_average()
    text = section(res, args.reps, time.time() - start, load)
    common.write_section(args.output, BEGIN, END, text)
    print(text)


if __name__ == "__main__":
    main()

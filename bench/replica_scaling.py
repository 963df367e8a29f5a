"""Two replicas vs one through the SDK's round robin, and the push to both.

Two ``megascore serve --model bench`` subprocesses (CPU, one thread each:
``OMP_NUM_THREADS=1``; ``--model`` picks another built-in: with ``tiny`` the client's
own encode / decode is as large as the forward, and the ratio measures the client).
The SDK scores the rollout length mix in requests of ``BATCH`` sequences,
``IN_FLIGHT`` in flight, once through a client of the first replica alone and once
through ``ipv4:a,b`` with ``load_balancing="round_robin"``, the order alternating per
repetition; tokens/s of each pass, the median of the per-repetition ratios (target:
2 replicas / 1 >= 1.7). Then the time of one ``push_weights`` (the embedding and final
norm in bf16, Megatron names, partial) to the first replica alone and to both (two
phases).

Two replicas can only scale when the machine has a free core for each: the load
average (at the start and the end) says how much of it the shared machine had.

Usage: ``python bench/replica_scaling.py [--model M] [--sequences N] [--reps R]`` writes (or
replaces) the section between the ``replica_scaling.py`` markers of RESULTS.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import tempfile
import time
from pathlib import Path

import common
import numpy as np
from e2e_vs_engine import start_server

HERE = Path(__file__).parent
BEGIN, END = "<!-- replica_scaling.py: begin -->", "<!-- replica_scaling.py: end -->"
BATCH, IN_FLIGHT = 8, 4
TARGET = 1.7


def tokens_per_s(client, sequences: list[np.ndarray]) -> float:
    chunks = [sequences[i : i + BATCH] for i in range(0, len(sequences), BATCH)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        list(pool.map(lambda chunk: client.score(chunk, losses=()), chunks))
    return sum(len(s) for s in sequences) / (time.perf_counter() - start)


def push_seconds(client, model: str, step: int, **kwargs) -> float:
    import torch

    from megascore.model.config import builtin_model

    cfg = builtin_model(model)
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    gen = torch.Generator().manual_seed(step)
    weights = {
        "embedding.word_embeddings.weight": torch.randn(vocab, hidden, generator=gen) * 0.05,
        "decoder.final_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
    }
    start = time.perf_counter()
    client.push_weights(
        [(k, v.to(torch.bfloat16)) for k, v in weights.items()],
        names="megatron",
        partial=True,
        **kwargs,
    )
    return time.perf_counter() - start


def measure(model: str, num: int, reps: int, workdir: Path) -> dict:
    from megascore.model.config import builtin_model
    from megascore_client import ScoringClient

    os.environ["OMP_NUM_THREADS"] = "1"
    vocab = builtin_model(model).vocab_size
    rollout, _ = common.make_workloads(num, seed=0, vocab_size=vocab, max_len=1024)
    servers = [start_server("cpu", 4096, workdir / f"r{i}.log", model=model) for i in range(2)]
    res: dict = {"one": [], "two": [], "push_one": [], "push_two": [], "summary": rollout.summary()}
    try:
        for server in servers:
            server.wait_serving(600)
        one = ScoringClient(servers[0].target, timeout=600)
        two = ScoringClient(
            "ipv4:" + ",".join(s.target for s in servers), load_balancing="round_robin", timeout=600
        )
        tokens_per_s(two, rollout.sequences[: BATCH * 2])  # warm both
        for rep in range(reps):
            for name, client in (("one", one), ("two", two))[:: 1 if rep % 2 == 0 else -1]:
                res[name].append(tokens_per_s(client, rollout.sequences))
            res["push_one"].append(push_seconds(one, model, rep, replicas=[servers[0].target]))
            res["push_two"].append(push_seconds(two, model, rep))
            print(f"rep {rep}: 1 replica {res['one'][-1]:.0f} tok/s, 2: {res['two'][-1]:.0f}")
        one.close()
        two.close()
        res["load_end"] = common.machine_info("cpu")["load average"]
    finally:
        for server in servers:
            server.stop()
    return res


def section(res: dict, model: str, reps: int, machine: dict, elapsed: float) -> str:
    med = statistics.median
    ratios = [b / a for a, b in zip(res["one"], res["two"], strict=True)]
    ratio = med(ratios)
    return (
        "\n".join(
            [
                BEGIN,
                "## Replicas: two vs one through the SDK's round robin",
                "",
                f"Written by `python bench/replica_scaling.py --model {model} --reps {reps}` in "
                f"{elapsed / 60:.1f} min ({machine['date']}, load average "
                f"{machine['load average']} at the start, {res['load_end']} at the end; "
                f"{machine.get('cpu', '')}); rerun it to update this section.",
                "",
                f"* two `megascore serve --model {model}` (CPU, OMP_NUM_THREADS=1 each); workload "
                f"`rollout`: {res['summary']}; requests of {BATCH} sequences, {IN_FLIGHT} in "
                "flight, logprobs only",
                "* push: embedding + final norm (bf16, Megatron names, partial) to the first "
                "replica (one phase) and to both (`ipv4:a,b`: prepare on both, then commit)",
                "",
                "| measurement | value | target | result |",
                "|---|---:|---|---|",
                f"| tokens/s, 1 replica | {med(res['one']):.0f} | | |",
                f"| tokens/s, 2 replicas (round robin) | {med(res['two']):.0f} | | |",
                f"| 2 replicas / 1 | {ratio:.2f} (reps {min(ratios):.2f}..{max(ratios):.2f}) | "
                f">= {TARGET} | {'pass' if ratio >= TARGET else 'MISS'} |",
                f"| push to 1 replica, s | {med(res['push_one']):.3f} | | |",
                f"| push to both (two phases), s | {med(res['push_two']):.3f} | | |",
                "",
                "Two replicas scale only with a free core each; on this shared 2-core machine "
                "the load average above is the ceiling of the ratio (a MISS under load measures "
                "the machine, not the replicas).",
                END,
            ]
        )
        + "\n"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench", help="built-in model served by both replicas")
    p.add_argument("--sequences", type=int, default=48)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args()
    common.quiet_logs()
    machine = common.machine_info("cpu")
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="megascore-replicas-") as tmp:
        res = measure(args.model, args.sequences, args.reps, Path(tmp))
    text = section(res, args.model, args.reps, machine, time.time() - start)
    common.write_section(args.output, BEGIN, END, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Cost of ``return_routing``: the same requests with and without the MoE routing.

A ``megascore serve --model tiny-moe`` subprocess (CPU); the SDK scores the rollout
length mix (logprobs, top-5 and the summed NLL, as the other benchmarks) in requests of
8 sequences, 2 in flight, once with ``return_routing=True`` and once without, the order
alternating per repetition. Two ratios, target <= 0.05 each:

1. wire: the extra server encode + client decode of the responses with the routing
   (``build_response`` + ``SerializeToString``, ``FromString`` + ``decode_part`` on the
   run's own results, in this process: CPU time with minus without, interleaved, median
   of 25) over the scoring time (the pass without routing);
2. end to end: ``(cost with - cost without) / cost without``, everything asking for
   the routing adds (the routers' RECORD on every rank, the gathers, the wire above, the
   bytes through gRPC), with cost = CPU seconds of the server process and the client
   (this process) over the pass: on a shared, loaded machine wall time swings by tens
   of percent between passes, CPU time barely (wall time is reported too). The median
   of the per-repetition ratios.

``tiny-moe`` is the worst case: its forward is tiny (hidden 64, 2 MoE layers of 4
experts) while its routing (2 layers x top-2 int32 = 16 bytes per token) is 4x the
logprobs; a real MoE model's forward grows much faster than its routing.

Usage: ``python bench/routing_cost.py [--sequences N] [--reps R] [--output bench/RESULTS.md]``
writes (or replaces) the section between the ``routing_cost.py`` markers of RESULTS.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import logging
import statistics
import tempfile
import time
from pathlib import Path

import common
import numpy as np
from e2e_vs_engine import start_server

from megascore_server.procfs import cpu_seconds

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
MODEL = "tiny-moe"
VOCAB = 512
BATCH = 8
IN_FLIGHT = 2
WIRE_REPEATS = 25
TARGET = 0.05
BEGIN, END = "<!-- routing_cost.py: begin -->", "<!-- routing_cost.py: end -->"


def score_pass(client, sequences: list[np.ndarray], routing: bool, server_pid: int):
    """Scores ``sequences`` in requests of ``BATCH``; returns (wall s, CPU s, results)."""
    chunks = [sequences[i : i + BATCH] for i in range(0, len(sequences), BATCH)]
    cpu = cpu_seconds(server_pid) + time.process_time()
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        results = list(
            pool.map(
                lambda chunk: client.score(
                    chunk, top_k=common.TOP_K, losses=common.LOSSES, return_routing=routing
                ),
                chunks,
            )
        )
    wall = time.perf_counter() - start
    return wall, cpu_seconds(server_pid) + time.process_time() - cpu, results


def wire_cases(results, with_routing: bool) -> list:
    """``(batch, output, part)`` of every response of a pass, for :func:`wire_seconds`."""
    from megascore.api.types import ScoreBatch, ScoreOutput
    from megascore_client.inputs import make_batch
    from megascore_client.splitting import ScoreOptions, build_parts

    options = ScoreOptions(top_k=common.TOP_K, losses=common.LOSSES, return_routing=with_routing)
    cases = []
    for i, res in enumerate(results):
        lengths = res.lengths
        batch = ScoreBatch(
            token_ids=np.zeros(int(lengths.sum()), np.int64),
            lengths=lengths,
            top_k=common.TOP_K,
            losses=common.LOSSES,
            return_routing=with_routing,
        )
        values = {
            "logprobs": np.concatenate(res.logprobs),
            "top_k_ids": np.concatenate(res.top_k_ids),
            "top_k_logprobs": np.concatenate(res.top_k_logprobs),
            "losses": {name: res.loss[name] for name in common.LOSSES},
            "num_loss_tokens": res.num_tokens,
            "cached_tokens": res.cached_tokens,
        }
        if with_routing:
            values["routing"] = np.concatenate(res.routing)
        output = ScoreOutput(values=values)
        (part,) = build_parts(
            make_batch([np.zeros(n, np.int64) for n in lengths]),
            options,
            f"r{i}",
            max_message_bytes=1 << 30,
        )
        cases.append((batch, output, part))
    return cases


def wire_seconds(cases) -> float:
    """CPU seconds of the server encode + client decode of a pass's responses."""
    from megascore.v1 import scoring_pb2 as pb
    from megascore_client.splitting import decode_part
    from megascore_server.convert import build_response

    start = time.process_time()
    for batch, output, part in cases:
        data = build_response(part.request.request_id, batch, output, pb.Timings())
        decode_part(pb.ScoreResponse.FromString(data.SerializeToString()), part)
    return time.process_time() - start


def measure(num_sequences: int, reps: int, seed: int, workdir: Path) -> dict:
    from megascore_client import ScoringClient

    rollout, _ = common.make_workloads(num_sequences, seed, VOCAB, max_len=1024)
    server = start_server("cpu", 4096, workdir / "serve.log", model=MODEL)
    try:
        server.wait_serving(300)
        with ScoringClient(server.target, timeout=600) as client:
            pid = server.proc.pid
            score_pass(client, common.warmup_sequences(rollout), True, pid)  # warm-up
            times = {True: [], False: []}
            cpu = {True: [], False: []}
            last = {}
            for rep in range(reps):
                for routing in (True, False) if rep % 2 == 0 else (False, True):
                    seconds, cpu_s, results = score_pass(client, rollout.sequences, routing, pid)
                    times[routing].append(seconds)
                    cpu[routing].append(cpu_s)
                    last[routing] = results
    finally:
        server.stop()
    with_r, without = last[True], last[False]
    max_diff = max(
        float(np.abs(a - b).max())
        for rw, ro in zip(with_r, without, strict=True)
        for a, b in zip(rw.logprobs, ro.logprobs, strict=True)
    )
    ratios = [(w - o) / o for w, o in zip(cpu[True], cpu[False], strict=True)]
    walls = [(w - o) / o for w, o in zip(times[True], times[False], strict=True)]
    routing_bytes = sum(r.nbytes for res in with_r for r in res.routing)
    cases = {True: wire_cases(with_r, True), False: wire_cases(without, False)}
    extra = []  # interleaved, CPU time: the shared machine's load barely moves it
    for _ in range(WIRE_REPEATS):
        extra.append(wire_seconds(cases[True]) - wire_seconds(cases[False]))
    return {
        "workload": rollout,
        "with_s": statistics.median(times[True]),
        "without_s": statistics.median(times[False]),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "wall_ratio": statistics.median(walls),
        "wall_ratios": walls,
        "cpu_with_s": statistics.median(cpu[True]),
        "cpu_without_s": statistics.median(cpu[False]),
        "routing_bytes": routing_bytes,
        "wire_extra_s": statistics.median(extra),
        "max_logprob_diff": max_diff,
        "shape": with_r[0].routing[0].shape[1:],
    }


def section(res: dict, reps: int, elapsed: float, load_start: str, load_end: str) -> str:
    w = res["workload"]
    tokens = w.num_tokens
    ratio, wire = res["ratio"], res["wire_extra_s"] / res["without_s"]
    layers, topk = res["shape"]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lo, hi = min(res["ratios"]), max(res["ratios"])
    wlo, whi = min(res["wall_ratios"]), max(res["wall_ratios"])

    def verdict(value: float) -> str:
        return "pass" if value <= TARGET else "MISS"

    return "\n".join(
        [
            BEGIN,
            "## MoE routing on the wire (return_routing)",
            "",
            f"Written by `python bench/routing_cost.py --reps {reps}` in {elapsed / 60:.1f} min "
            f"({now}, load average {load_start} at the start, {load_end} at the end); rerun it "
            "to update this section.",
            "",
            f"* model `{MODEL}` (CPU, float32; {layers} MoE layers x top-{topk}), "
            f"`megascore serve` subprocess, SDK client; workload `rollout`: {w.summary()}",
            f"* requests of {BATCH} sequences, {IN_FLIGHT} in flight, logprobs + top-5 + NLL; "
            f"with and without `return_routing`, order alternating, {reps} repetitions, median",
            "",
            "| measurement | value | target | result | measured |",
            "|---|---:|---|---|---|",
            f"| wire: routing encode + decode / scoring time | {wire:.5f} | <= {TARGET} | "
            f"{verdict(wire)} | {res['wire_extra_s'] * 1e3:.2f} ms more server encode + "
            f"client decode for {res['routing_bytes'] / 1e6:.2f} MB of routing "
            f"({res['routing_bytes'] / tokens:.0f} bytes per token) / scoring "
            f"{res['without_s']:.2f} s for {tokens} tokens |",
            f"| end to end: extra CPU with return_routing / CPU without | {ratio:.4f} | "
            f"<= {TARGET} | {verdict(ratio)} | server + client CPU with "
            f"{res['cpu_with_s']:.2f} s / without {res['cpu_without_s']:.2f} s (reps "
            f"{lo:+.4f}..{hi:+.4f}); wall with {res['with_s']:.2f} s / without "
            f"{res['without_s']:.2f} s, ratio {res['wall_ratio']:+.4f} (reps "
            f"{wlo:+.4f}..{whi:+.4f}); logprobs with / without max abs diff "
            f"{res['max_logprob_diff']:.1e} |",
            "",
            "tiny-moe is the worst case for this ratio (a forward of hidden size 64 against "
            f"{4 * layers * topk} routing bytes per token); the ratio falls as the model grows.",
            END,
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, default=96)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    common.quiet_logs()
    start, load_start = time.time(), common.load_average()
    with tempfile.TemporaryDirectory() as tmp:
        res = measure(args.sequences, args.reps, args.seed, Path(tmp))
    text = section(res, args.reps, time.time() - start, load_start, common.load_average())
    common.write_section(args.output, BEGIN, END, text)
    print(text)


if __name__ == "__main__":
    main()

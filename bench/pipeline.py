"""Pipeline parallelism: PP=2 vs PP=1 tokens/s on the same model and CPU, microbatches swept.

``python bench/pipeline.py`` runs two torchrun jobs on this machine, one after the
other, with the same model and the same step (``--sequences`` x ``--length``
tokens, logprobs + top-5):

* PP=1: one rank;
* PP=2: two ranks;

every rank with ``--threads`` intra-op threads (default 1: on a shared machine a
multi-threaded rank loses most of its time in OpenMP barriers, which would flatter
PP=2; the ideal PP=2 / PP=1 ratio is then ``2 x (1 - bubble)``);

and in each job, for every microbatch count of ``--microbatches`` (1, 2, 4, 8), a
fresh engine scores the step ``--warmup`` + ``--reps`` times (the median timed step
counts). In the PP=2 job every rank also adds up the time it spends computing (the
forward-step function and the loss closure of Megatron's schedule); the rest of
the step is waiting: the pipeline bubble plus the p2p / result transfers. The
"measured idle" column is ``1 - busy / wall`` averaged over the two ranks; the
forward-only 1F1B schedule's bubble is ``(PP - 1) / (m + PP - 1)`` of an evenly
split step. The results replace the "Pipeline parallelism" section of
``bench/RESULTS.md`` (``--output``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- pipeline:begin -->", "<!-- pipeline:end -->"


def worker(args: argparse.Namespace) -> None:
    """One torchrun rank: engines at ``--pp`` for every microbatch count, timed on rank 0."""
    import numpy as np
    import torch.distributed as dist

    from megascore.api.types import ScoreBatch
    from megascore.config import EngineConfig
    from megascore.engine.runtime import DistributedEngine
    from megascore.engine.schedule import pipeline
    from megascore.model.config import builtin_model

    busy = {"s": 0.0}

    def timed(fn):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                busy["s"] += time.perf_counter() - start

        return wrapper

    pipeline.forward_step = timed(pipeline.forward_step)
    pipeline._score_microbatch = timed(pipeline._score_microbatch)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    rng = np.random.default_rng(0)
    vocab = builtin_model(args.model).vocab_size
    lengths = np.full(args.sequences, args.length, dtype=np.int64)
    batch = ScoreBatch(
        token_ids=rng.integers(0, vocab, int(lengths.sum())).astype(np.int64),
        lengths=lengths,
        top_k=5,
        losses=("nll",),
    )
    results = {}
    for m in args.microbatches:
        engine = DistributedEngine.create(
            EngineConfig(
                model=args.model,
                device="cpu",
                pipeline_model_parallel_size=args.pp,
                pipeline_microbatches=m,
                collective_timeout_s=600,
                prefix_cache=False,  # repeated steps: their computation, not the cache
            )
        )
        busy["s"] = 0.0
        if rank != 0:
            engine.worker_loop()  # until rank 0's SHUTDOWN
            results[m] = {"busy_s": busy["s"] / (args.warmup + args.reps)}  # per step
            continue
        walls, busy_timed = [], 0.0
        for i in range(args.warmup + args.reps):
            before = busy["s"]
            start = time.perf_counter()
            engine.score(batch)
            if i >= args.warmup:
                walls.append(time.perf_counter() - start)
                busy_timed += busy["s"] - before
        engine.shutdown()
        results[m] = {"walls_s": walls, "busy_s": busy_timed / args.reps}  # per timed step
        print(f"pp={args.pp} m={m}: {statistics.median(walls):.2f} s/step", flush=True)
    (Path(args.out) / f"pp{args.pp}_rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def run_job(args: argparse.Namespace, pp: int, out: Path) -> None:
    from megascore_server.ports import pick_port

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), CUDA_VISIBLE_DEVICES="")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={pp}",
        "--master-addr=127.0.0.1",
        f"--master-port={pick_port()}",
        "--max-restarts=0",
        str(Path(__file__).resolve()),
        "--worker",
        "--pp",
        str(pp),
        "--out",
        str(out),
        "--model",
        args.model,
        "--sequences",
        str(args.sequences),
        "--length",
        str(args.length),
        "--warmup",
        str(args.warmup),
        "--reps",
        str(args.reps),
        "--threads",
        str(args.threads),
        "--microbatches",
        ",".join(map(str, args.microbatches)),
    ]
    subprocess.run(cmd, env=env, check=True)


def report(args: argparse.Namespace, out: Path, seconds: float) -> str:
    pp1 = json.loads((out / "pp1_rank0.json").read_text())
    pp2 = [json.loads((out / f"pp2_rank{r}.json").read_text()) for r in range(2)]
    tokens = args.sequences * args.length
    load = common.load_average()
    lines = [
        BEGIN,
        "## Pipeline parallelism",
        "",
        f"Written by `python bench/pipeline.py` in {seconds / 60:.1f} min "
        f"({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} "
        f"cores, load average at the end {load}). Model `{args.model}`, float32, "
        f"one step of {args.sequences} x {args.length} tokens (logprobs + top-5), median "
        f"of {args.reps} timed steps after {args.warmup} warm-up; every rank "
        f"{args.threads} thread(s), so PP=1 uses {args.threads} core(s) and PP=2 twice "
        "that. No GPU was available: NCCL is not measured.",
        "",
        "| microbatches m | PP=1 tokens/s | PP=2 tokens/s | PP=2 / PP=1 | ideal 2 x (1 - "
        "bubble) | 1F1B bubble (PP-1)/(m+PP-1) | PP=2 measured idle (bubble + transfers) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in args.microbatches:
        key = str(m)
        t1 = statistics.median(pp1[key]["walls_s"])
        t2 = statistics.median(pp2[0][key]["walls_s"])
        idle = 1 - statistics.mean(pp2[r][key]["busy_s"] / t2 for r in range(2))
        lines.append(
            f"| {m} | {tokens / t1:.0f} | {tokens / t2:.0f} | {t1 / t2:.2f} | "
            f"{2 * (1 - 1 / (m + 1)):.2f} | {1 / (m + 1):.2f} | {idle:.2f} |"
        )
    lines += [
        "",
        "Reading it: PP splits the layers over twice the cores; the stages overlap only "
        "on different microbatches, so PP=2 / PP=1 approaches 2 as the bubble shrinks "
        "with more microbatches, minus what smaller matrix multiplications per "
        "microbatch cost. The measured idle share includes the warm-up / cool-down "
        "bubble, the activation sends between stages and the result broadcast to "
        "rank 0 (and, on a loaded machine, time the OS gives to other processes).",
        END,
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench")
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--microbatches", default="1,2,4,8")
    p.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.microbatches = [int(x) for x in str(args.microbatches).split(",")]
    if args.worker:
        worker(args)
        return 0
    import tempfile

    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for pp in (1, 2):
            run_job(args, pp, out)
        section = report(args, out, time.monotonic() - start)
    print(section)
    common.write_section(args.output, BEGIN, END, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())

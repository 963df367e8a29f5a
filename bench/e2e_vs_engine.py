"""End-to-end gRPC throughput vs the engine called in-process, on the same batches.

* **engine**: ``DistributedEngine.score`` in this process on the workload's
  token-budget batches (arrival order);
* **e2e**: a real ``megascore serve --model bench`` subprocess (its
  ``--max-tokens-per-batch`` is the same budget) and, in another process, the
  SDK's ``AsyncScoringClient`` sending the same batches as requests, up to
  ``--concurrency`` in flight. Tokens/s is measured by the client from the first
  request sent to the last response decoded, so it includes the client's
  encode / decode, gRPC, validation, dynamic batching and response building.

Requests ask for logprobs, the top-5 alternatives and the summed NLL. The
server is torn down by PID (SIGTERM, then SIGKILL after a grace period). The
e2e logprobs are compared with the in-process ones.

Usage::

    python bench/e2e_vs_engine.py [--device cpu|cuda] [--num-sequences N]
    python bench/e2e_vs_engine.py client --target HOST:PORT --requests F.npz --out F.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import logging
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from megascore_server.serve_process import ServeProcess

logger = logging.getLogger(__name__)

CONCURRENCY = 4
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def subprocess_env() -> dict[str, str]:
    """This environment without the torch.distributed variables of the in-process engine."""
    return {k: v for k, v in os.environ.items() if k not in _DIST_ENV}


# ---- server ---------------------------------------------------------------------------------


def start_server(
    device: str,
    max_tokens: int,
    log_path: Path,
    model: str = "bench",
    extra_args: tuple[str, ...] = (),
    prefix_cache: bool = False,
) -> ServeProcess:
    """A ``megascore serve`` subprocess on 127.0.0.1 with its metrics endpoint.

    Args:
        device: "cpu" or "cuda".
        max_tokens: ``--max-tokens-per-batch``.
        log_path: where the server's stdout / stderr go.
        model: ``--model``.
        extra_args: more ``megascore serve`` flags.
        prefix_cache: keep the server's prefix cache between calls (its default); False
            adds ``--no-prefix-cache``: a benchmark that sends the same requests again
            measures their computation, not the cache (``bench/prefix_cache.py`` does).

    Returns:
        The started :class:`megascore_server.serve_process.ServeProcess`
        (``wait_serving``, then ``stop``: SIGTERM, SIGKILL after a grace period).
    """
    import common

    from megascore_server.serve_process import ServeProcess

    flags = ["--model", model, "--device", device, "--dtype", common.dtype_name(device)]
    flags += ["--max-tokens-per-batch", str(max_tokens), *extra_args]
    flags += [] if prefix_cache else ["--no-prefix-cache"]
    server = ServeProcess(log_path, *flags, metrics=True)
    logger.info("started %s (pid %d)", " ".join(server.cmd), server.pid)
    return server


def step_stats(metrics_url: str) -> tuple[float, float]:
    """``(engine steps run, seconds spent in them)`` from a server's Prometheus metrics."""
    with urllib.request.urlopen(metrics_url, timeout=30) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("megascore_steps_total", "megascore_step_latency_seconds_sum"):
            values[name] = float(value)
    return values["megascore_steps_total"], values["megascore_step_latency_seconds_sum"]


# ---- client process -------------------------------------------------------------------------


def write_requests(path: Path, sequences: list[np.ndarray], batches: list[list[int]]) -> None:
    """Stores the requests (sequence indices per request, in order) for the client process."""
    order = np.array([i for batch in batches for i in batch], dtype=np.int64)
    np.savez(
        path,
        token_ids=np.concatenate([sequences[i] for i in order]),
        lengths=np.array([len(sequences[i]) for i in order], dtype=np.int64),
        order=order,
        request_sizes=np.array([len(b) for b in batches], dtype=np.int64),
    )


async def _client_run(args: argparse.Namespace) -> dict:
    from megascore_client import AsyncScoringClient
    from megascore_server.procfs import cpu_seconds

    data = np.load(args.requests)
    flat = np.split(data["token_ids"], np.cumsum(data["lengths"])[:-1])
    bounds = np.concatenate([[0], np.cumsum(data["request_sizes"])])
    requests = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    async with AsyncScoringClient(args.target, timeout=3600.0) as client:
        await client.wait_until_serving(timeout=600.0)
        await client.request_token_limit()
        warm = [seq[:256] for seq in requests[0][:4]]  # common.warmup_sequences
        await client.score(warm, top_k=args.top_k, losses=("nll",))
        slots = asyncio.Semaphore(args.concurrency)

        async def one(seqs):
            async with slots:
                return await client.score(seqs, top_k=args.top_k, losses=("nll",))

        steps_before, busy_before = step_stats(args.metrics_url)
        server_cpu = cpu_seconds(args.server_pid)
        cpu, start = time.process_time(), time.perf_counter()
        results = await asyncio.gather(*(one(r) for r in requests))
        seconds = time.perf_counter() - start
        client_cpu = time.process_time() - cpu
        server_cpu = cpu_seconds(args.server_pid) - server_cpu
        steps_after, busy_after = step_stats(args.metrics_url)
    requests_detail = [
        {
            "tokens": int(sum(len(s) for s in seqs)),
            "client_ms": res.timings.client_ms,
            "total_ms": res.timings.total_ms,
            "queue_ms": res.timings.queue_ms,
            "compute_ms": res.timings.compute_ms,
            "steps": res.timings.num_steps,
        }
        for seqs, res in zip(requests, results, strict=True)
    ]
    logprobs = [lp for res in results for lp in res.logprobs]
    np.save(args.out.with_suffix(".npy"), np.concatenate(logprobs))
    return {
        "seconds": seconds,
        "tokens": int(data["lengths"].sum()),
        "requests": len(requests),
        "server_compute_ms": sum(r.timings.compute_ms for r in results),
        "server_queue_ms_mean": float(np.mean([r.timings.queue_ms for r in results])),
        "server_total_ms_sum": sum(r.timings.total_ms for r in results),
        "client_ms_sum": sum(r.timings.client_ms for r in results),
        "server_steps": sum(r.timings.num_steps for r in results),
        "per_request": requests_detail,
        "client_cpu_s": client_cpu,
        "server_cpu_s": server_cpu,
        "engine_steps": steps_after - steps_before,
        "engine_step_s": busy_after - busy_before,
    }


def client_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="e2e_vs_engine.py client")
    p.add_argument("--target", required=True)
    p.add_argument("--metrics-url", required=True, help="the server's Prometheus endpoint")
    p.add_argument("--server-pid", type=int, required=True, help="for its CPU time")
    p.add_argument("--requests", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--concurrency", type=int, default=CONCURRENCY)
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="cProfile the timed part")
    args = p.parse_args(argv)
    if args.profile:  # cProfile here: this process stays torch-free (no ``common`` import)
        prof = cProfile.Profile()
        result = prof.runcall(asyncio.run, _client_run(args))
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("cumulative").print_stats(15)
        text = buf.getvalue()
        result["profile"] = text[text.find("   ncalls") :].rstrip()
    else:
        result = asyncio.run(_client_run(args))
    args.out.write_text(json.dumps(result))


def e2e_pass(
    server: ServeProcess,
    sequences: list[np.ndarray],
    batches: list[list[int]],
    workdir: Path,
    *,
    concurrency: int = CONCURRENCY,
    profile: bool = False,
    timeout: float = 3600.0,
) -> tuple[dict, list[np.ndarray]]:
    """Runs the client process once over ``batches``.

    Returns:
        ``(summary, per-sequence logprobs in workload order)``: the client's ``seconds``,
        per-request timings, the CPU seconds of the client and the server processes
        and, from the server's metrics, ``engine_steps`` and ``engine_step_s``
        (seconds its engine was busy), all over the timed part.
    """
    import common

    requests, out = workdir / "requests.npz", workdir / "client.json"
    write_requests(requests, sequences, batches)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "client",
        "--target",
        server.target,
        "--metrics-url",
        server.metrics_url,
        "--server-pid",
        str(server.proc.pid),
        "--requests",
        str(requests),
        "--out",
        str(out),
        "--concurrency",
        str(concurrency),
        "--top-k",
        str(common.TOP_K),
    ]
    if profile:
        cmd.append("--profile")
    proc = subprocess.run(
        cmd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"client failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads(out.read_text())
    flat = np.load(out.with_suffix(".npy"))
    order = [i for batch in batches for i in batch]
    lens = [len(sequences[i]) for i in order]
    parts = np.split(flat, np.cumsum(lens)[:-1])
    logprobs: list[np.ndarray | None] = [None] * len(sequences)
    for i, lp in zip(order, parts, strict=True):
        logprobs[i] = lp
    return summary, logprobs


def decompose(engine_seconds: float, summary: dict) -> tuple[float, float]:
    """e2e/engine = (server engine busy / e2e wall) x (server step speed / in-process speed).

    Returns:
        ``(busy fraction, server step tokens/s over in-process tokens/s)``. The first
        factor is the serving overhead (both terms come from the same pass, so the
        machine's load cancels out); the second is the same engine code timed at
        another moment in another process: load noise, or CPU taken from the engine
        by the client and the gRPC threads.
    """
    busy = summary["engine_step_s"] / summary["seconds"]
    speed = engine_seconds / summary["engine_step_s"] if summary["engine_step_s"] else 0.0
    return busy, speed


def explain(engine_seconds: list[float], summaries: list[dict]) -> str:
    """Where the e2e time went (medians over repetitions)."""
    engine_s = statistics.median(engine_seconds)
    wall = statistics.median(s["seconds"] for s in summaries)
    busy_s = statistics.median(s["engine_step_s"] for s in summaries)
    steps = statistics.median(s["engine_steps"] for s in summaries)
    idle = wall - busy_s
    return (
        f"e2e took {wall:.2f} s for what the in-process engine scores in {engine_s:.2f} s "
        f"({wall / engine_s - 1:+.1%}). The server's engine ran {steps:g} steps for "
        f"{busy_s:.2f} s ({busy_s / wall:.1%} of the e2e wall; idle {idle:.2f} s: client "
        f"encode, transfer, validation, batching, the tail response). Its steps took "
        f"{busy_s / engine_s:.2f}x the in-process time for the same tokens"
        + (
            f": with the server's engine busy {busy_s / wall:.0%} of the time, the serving "
            "path costs little; the engine itself ran slower in the server pass than in the "
            "in-process one. Same code: either the client process and the gRPC threads took "
            "CPU from it, or the machine's load changed between the two (compare the CPU-time "
            "ratio in the table, and the other workload's row)."
            if busy_s > 1.05 * engine_s
            else "."
        )
    )


def request_table(summary: dict) -> str:
    """Per-request timings of one e2e pass: client wall vs the server's own account."""
    lines = [
        f"e2e pass: {summary['seconds']:.2f} s wall (client), {summary['requests']} requests",
        f"{'request':>8}{'tokens':>8}{'client ms':>12}{'server ms':>12}{'queue ms':>10}"
        f"{'compute ms':>12}{'steps':>7}{'client-server ms':>18}",
    ]
    for i, r in enumerate(summary["per_request"]):
        lines.append(
            f"{i:>8}{r['tokens']:>8}{r['client_ms']:>12.1f}{r['total_ms']:>12.1f}"
            f"{r['queue_ms']:>10.1f}{r['compute_ms']:>12.1f}{r['steps']:>7}"
            f"{r['client_ms'] - r['total_ms']:>18.1f}"
        )
    lines.append(
        "server ms: arrival to response built; compute ms: the engine steps that held the "
        "request's sequences (shared steps count for each); client-server: encode, transfer, "
        "decode"
    )
    return "\n".join(lines)


# ---- standalone -----------------------------------------------------------------------------


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        client_main(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--num-sequences", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    import common

    common.quiet_logs()
    common.check_device(args.device)
    with tempfile.TemporaryDirectory(prefix="megascore-bench-") as tmp:
        workdir = Path(tmp)
        server = start_server(args.device, args.max_tokens, workdir / "server.log")
        engine = None
        try:
            engine = common.create_engine(args.device)
            rollout, uniform = common.make_workloads(
                args.num_sequences, args.seed, engine.info().vocab_size
            )
            server.wait_serving(900.0)
            for workload in (rollout, uniform):
                batches = workload.batches(args.max_tokens)
                ours = common.engine_pass(engine, workload, args.max_tokens)
                t_engine, lp_engine = ours.seconds, ours.logprobs
                summary, lp_e2e = e2e_pass(server, workload.sequences, batches, workdir)
                diff = max(
                    float(np.abs(a - b).max()) for a, b in zip(lp_engine, lp_e2e, strict=True)
                )
                tokens = workload.num_tokens
                print(
                    f"{workload.name}: {workload.summary()}\n  engine {tokens / t_engine:.1f} "
                    f"tokens/s, e2e {tokens / summary['seconds']:.1f} tokens/s, e2e/engine "
                    f"{t_engine / summary['seconds']:.3f}, max |dlogprob| {diff:.1e}"
                )
        finally:
            if engine is not None:
                engine.shutdown()
            with contextlib.suppress(Exception):
                server.stop()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()

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
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

CONCURRENCY = 4
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def subprocess_env() -> dict[str, str]:
    """This environment without the torch.distributed variables of the in-process engine."""
    return {k: v for k, v in os.environ.items() if k not in _DIST_ENV}


# ---- server ---------------------------------------------------------------------------------


class Server:
    """A ``megascore serve`` subprocess on 127.0.0.1, stopped by PID.

    Args:
        device: "cpu" or "cuda".
        max_tokens: ``--max-tokens-per-batch``.
        log_path: where the server's stdout / stderr go.
        model: ``--model``.
    """

    def __init__(self, device: str, max_tokens: int, log_path: Path, model: str = "bench"):
        import common

        self.port = common.free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        exe = Path(sys.executable).with_name("megascore")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "megascore_client.cli"]
        self.cmd = [
            *cmd,
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--model",
            model,
            "--device",
            device,
            "--dtype",
            common.dtype_name(device),
            "--max-tokens-per-batch",
            str(max_tokens),
        ]
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=subprocess_env()
        )
        logger.info("started %s (pid %d)", " ".join(self.cmd), self.proc.pid)
        return self

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def wait_serving(self, timeout: float) -> None:
        """Waits for health SERVING; raises with the log tail when the process died."""
        from megascore_client import ScoringClient, ScoringError

        deadline = time.monotonic() + timeout
        with ScoringClient(self.target, retries=None) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"server exited with {self.proc.returncode}:\n{self.log_tail()}"
                    )
                try:
                    client.wait_until_serving(timeout=5.0)
                    return
                except ScoringError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"server not SERVING after {timeout:.0f}s:\n{self.log_tail()}"
                        ) from None

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM by PID, SIGKILL after ``grace`` seconds; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                logger.warning("server pid %d ignored SIGTERM; killing it", self.proc.pid)
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


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

        start = time.perf_counter()
        results = await asyncio.gather(*(one(r) for r in requests))
        seconds = time.perf_counter() - start
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
    }


def client_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="e2e_vs_engine.py client")
    p.add_argument("--target", required=True)
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
    target: str,
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
        ``(the client's summary dict, per-sequence logprobs in workload order)``.
    """
    import common

    requests, out = workdir / "requests.npz", workdir / "client.json"
    write_requests(requests, sequences, batches)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "client",
        "--target",
        target,
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


def explain(engine_seconds: list[float], summaries: list[dict]) -> str:
    """Where the e2e time went, from the server's own timings (medians over repetitions)."""
    engine_s = statistics.median(engine_seconds)
    wall = statistics.median(s["seconds"] for s in summaries)
    compute = statistics.median(s["server_compute_ms"] for s in summaries) / 1e3
    steps = statistics.median(s["server_steps"] for s in summaries)
    requests = summaries[0]["requests"]
    return (
        f"e2e took {wall:.2f} s for what the in-process engine scores in {engine_s:.2f} s "
        f"(+{wall - engine_s:.2f} s, {wall / engine_s - 1:.1%}). The server's engine steps "
        f"took {compute:.2f} s in total over {requests} requests / {steps:g} request-steps "
        f"(a step shared by two requests counts twice), {compute / engine_s:.2f}x the "
        f"in-process time: "
        + (
            "the engine itself ran slower inside the server (the client process, gRPC "
            "threads and the event loop share the CPU with its matmul threads)."
            if compute > 1.05 * engine_s
            else "the engine ran as fast as in-process; the rest is outside the steps "
            "(client encode/decode, transfer, validation, batching waits, response building)."
        )
        + f" Outside the steps: {max(wall - compute, 0.0):.2f} s."
    )


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
        server = Server(args.device, args.max_tokens, workdir / "server.log").start()
        engine = None
        try:
            engine = common.create_engine(args.device)
            rollout, uniform = common.make_workloads(
                args.num_sequences, args.seed, engine.info().vocab_size
            )
            server.wait_serving(900.0)
            for workload in (rollout, uniform):
                batches = workload.batches(args.max_tokens)
                t_engine, lp_engine = common.engine_pass(engine, workload, args.max_tokens)
                summary, lp_e2e = e2e_pass(server.target, workload.sequences, batches, workdir)
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

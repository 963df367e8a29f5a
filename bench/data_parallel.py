"""Expert parallelism shares the work: ``megascore serve --nproc 2 --ep 2`` vs ``--nproc 1``.

A random Qwen3-MoE-shaped ``transformers`` checkpoint (every layer MoE: 8 experts,
top-2, QK-norm, GQA) is written to a temporary directory and served twice from
``hf:DIR`` on the CPU (fp32, the "torch" attention backend), each server a real
``megascore serve`` subprocess with one intra-op thread per rank (``OMP_NUM_THREADS=1``:
the one-rank server uses one core, the EP=2 server two; the ideal ratio is 2):

* ``--nproc 1``: one rank scores every step;
* ``--nproc 2 --ep 2``: two ranks; each holds half of the experts, and each step's
  sequences are split between the two data-parallel ranks (balanced by tokens,
  ``megascore.engine.schedule.data_parallel``), the tokens routed to the other rank's experts
  travel through Megatron's token dispatcher (allgather on the CPU).

Workload: the rollout length mix of ``bench/common.py`` (log-normal, median 400,
clipped to [16, 2048]), ``--num`` sequences in one request per repetition (logprobs,
top-5, NLL); the server cuts it into steps of ``--max-tokens-per-batch`` tokens. Both
servers stay up; the repetitions alternate between them after a warm-up, and the value
is the median ratio of the repetitions' tokens/s. The outputs of the two servers are
compared (max abs difference of logprobs and top-5 logprobs, top-5 ids equal).

    python bench/data_parallel.py [--reps 5] [--num 48]

Writes (or replaces) the "Expert / data parallelism" section of ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import common
import numpy as np

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- data_parallel.py: begin -->", "<!-- data_parallel.py: end -->"
SECTION = "## Expert / data parallelism (`bench/data_parallel.py`)"
TARGET = 1.6
DIMS = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    intermediate_size=512,
    vocab_size=8192,
    max_position_embeddings=2048,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    norm_topk_prob=True,
)


def write_checkpoint(directory: Path) -> int:
    """Saves the random Qwen3-MoE model; returns its parameter count."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**DIMS)).eval()
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def score(client, server, workload) -> tuple[float, float, object]:
    """``(wall seconds, server CPU seconds, result)`` of one request with the workload."""
    cpu, start = server.cpu_seconds(), time.perf_counter()
    result = client.score(workload.sequences, top_k=common.TOP_K, losses=common.LOSSES)
    return time.perf_counter() - start, server.cpu_seconds() - cpu, result


def max_diff(a, b) -> float:
    return float(max(np.abs(x - y).max(initial=0.0) for x, y in zip(a, b, strict=True)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--num", type=int, default=48, help="sequences in the workload")
    p.add_argument("--max-tokens-per-batch", type=int, default=16384)  # the server default
    p.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args()
    common.quiet_logs()
    from megascore_client import ScoringClient
    from megascore_server.serve_process import CPU_ONE_THREAD, ServeProcess

    machine = common.machine_info("cpu")
    workload, _ = common.make_workloads(args.num, 0, DIMS["vocab_size"])
    layouts = {"nproc 1": ["--nproc", "1"], "nproc 2, ep 2": ["--nproc", "2", "--ep", "2"]}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        num_parameters = write_checkpoint(Path(tmp) / "ckpt")
        flags = [
            "--model", f"hf:{Path(tmp) / 'ckpt'}", "--device", "cpu", "--dtype", "float32",
            "--max-tokens-per-batch", str(args.max_tokens_per_batch),
            "--no-prefix-cache",  # repeated requests: their computation, not the cache
        ]  # fmt: skip
        servers = {}
        try:
            for name, extra in layouts.items():
                log = Path(tmp) / f"{name.replace(' ', '_').replace(',', '')}.log"
                servers[name] = ServeProcess(log, *flags, *extra, env=CPU_ONE_THREAD)
            for server in servers.values():
                server.wait_serving()
            clients = {name: ScoringClient(s.target) for name, s in servers.items()}
            outputs = {  # warm-up
                name: score(c, servers[name], workload)[2] for name, c in clients.items()
            }
            seconds: dict[str, list[float]] = {name: [] for name in servers}
            cpu: dict[str, list[float]] = {name: [] for name in servers}
            for rep in range(args.reps):
                order = list(clients) if rep % 2 == 0 else list(reversed(clients))
                for name in order:
                    wall, used, _ = score(clients[name], servers[name], workload)
                    seconds[name].append(wall)
                    cpu[name].append(used)
            for c in clients.values():
                c.close()
        finally:
            for server in servers.values():
                server.close()
    one, two = (outputs[name] for name in layouts)
    diff_lp = max_diff(one.logprobs, two.logprobs)
    diff_top = max_diff(one.top_k_logprobs, two.top_k_logprobs)
    ids_equal = all(np.array_equal(a, b) for a, b in zip(one.top_k_ids, two.top_k_ids, strict=True))
    tokens = workload.num_tokens
    speed = {name: [tokens / s for s in v] for name, v in seconds.items()}
    ratios = [b / a for a, b in zip(*speed.values(), strict=True)]
    ratio = float(np.median(ratios))
    cpu_per_kt = {name: [1000 * c / tokens for c in v] for name, v in cpu.items()}
    work = float(np.median(cpu_per_kt[list(layouts)[1]]) / np.median(cpu_per_kt["nproc 1"]))
    rows = [
        f"| `{name}` | {np.median(v):.0f} ({min(v):.0f}..{max(v):.0f}) | {max(v):.0f} "
        f"| {np.median(cpu_per_kt[name]):.2f} |"
        for name, v in speed.items()
    ]
    minutes = (time.perf_counter() - started) / 60
    met = "met" if ratio >= TARGET else "missed"
    text = "\n".join(
        [
            BEGIN,
            SECTION,
            "",
            f"Written by `python bench/data_parallel.py --reps {args.reps} --num {args.num}` in "
            f"{minutes:.1f} min ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"{machine['cpu']}, load average {machine['load average']} at the start, torch "
            f"{machine['torch']}). Random Qwen3-MoE checkpoint ({num_parameters / 1e6:.1f}M "
            "parameters: 4 layers, hidden 256, every layer 8 experts top-2) served from "
            "`hf:DIR`, float32, one thread per rank; workload "
            f"{workload.summary()} in one request (logprobs, top-5, NLL), steps of "
            f"{args.max_tokens_per_batch} tokens; {args.reps} alternating repetitions after "
            "a warm-up.",
            "",
            "| `megascore serve` | tokens/s median (min..max) | best tokens/s "
            "| CPU s / 1k tokens (all ranks, median) |",
            "|---|---:|---:|---:|",
            *rows,
            "",
            f"**EP=2 / one rank tokens/s: {ratio:.2f}** (repetitions {min(ratios):.2f}.."
            f"{max(ratios):.2f}; target >= {TARGET}: {met}; ideal 2 on two cores). Outputs: "
            f"max abs difference {diff_lp:.1e} (logprobs), {diff_top:.1e} (top-5 logprobs), "
            f"top-5 ids {'equal' if ids_equal else 'DIFFERENT'}. Work: the EP=2 server's "
            f"ranks together use {work:.2f}x the CPU time per token of the one-rank server "
            "(1.0: nothing is computed twice; when every EP rank scored the whole batch, each "
            "repeated all attention and dense work). With that work split, the wall-clock "
            f"ratio on two otherwise idle cores would be about 2 / {work:.2f} = "
            f"{2 / work:.2f} (an estimate, not a measurement); the measured ratio also "
            "depends on how often the other processes on the machine (load average above) "
            "leave both ranks a core at the same time: they meet in collectives in every "
            "MoE layer.",
            END,
        ]
    )
    print(text)
    common.write_section(args.output, BEGIN, END, text)
    return 0 if ids_equal and max(diff_lp, diff_top) <= 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())

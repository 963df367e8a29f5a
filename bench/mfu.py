"""How close the engine gets to the hardware: model FLOP/s over measured ``torch.mm`` FLOP/s.

* model FLOPs of a batch: ``2 * P * tokens`` with ``P`` the parameters that take
  part in a matmul (all but the input embedding table; the output layer counts)
  plus causal attention, ``2 * 2 * heads * head_dim * L (L + 1) / 2`` per layer
  and sequence (``common.model_flops``);
* achieved: model FLOPs of the workload / seconds of the in-process engine pass
  (the whole ``score`` call: packing, forward, chunked logprobs and top-k, unpacking);
* machine: ``torch.mm`` of two square matrices in the benchmark dtype (fp32 on
  the CPU, bf16 on a GPU): the median rate of 5 calls right before and 5 right
  after each engine pass, averaged (a shared machine's load then weighs on both
  sides alike).

Usage: ``python bench/mfu.py [--device cpu|cuda] [--num-sequences N]``.
"""

from __future__ import annotations

import argparse
import logging

import common

logger = logging.getLogger(__name__)


def matmul_size(device: str) -> int:
    """Square size of the reference matmul: large enough to reach the machine's rate."""
    return 8192 if device == "cuda" else 2048


def machine_rate(device: str, calls: int = 5) -> tuple[float, float]:
    """Measured dense matmul ``(wall, CPU-time)`` FLOP/s in the benchmark dtype."""
    return common.matmul_flops_per_s(device, matmul_size(device), calls)


def bracketed_engine_pass(engine, workload, max_tokens: int, device: str):
    """An engine pass with the matmul rate measured right before and right after it.

    Returns:
        ``(common.Pass, (wall, CPU-time) matmul FLOP/s: means of before and after)``.
    """
    before = machine_rate(device)
    result = common.engine_pass(engine, workload, max_tokens)
    after = machine_rate(device)
    return result, ((before[0] + after[0]) / 2, (before[1] + after[1]) / 2)


def achieved(engine, workload: common.Workload, seconds: float) -> float:
    """Model FLOP/s of an engine pass over ``workload`` that took ``seconds``."""
    info = engine.info()
    return common.model_flops(engine.loaded.config, info.num_parameters, workload.lengths) / seconds


_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product")
_GPU_GEMM_WORDS = ("gemm", "cutlass", "flash", "fmha", "attn", "sm90", "nvjet")


def step_profile(engine, workload: common.Workload, max_tokens: int, device: str):
    """Profiles one engine step; returns (share of time in matmul/attention ops, top-ops table).

    On the CPU the share is of the ops' self CPU time; on a GPU, of kernel time.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    seqs = [workload.sequences[i] for i in workload.batches(max_tokens)[0]]
    batch = common.score_batch(seqs)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        engine.score(batch)
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    if device == "cuda":
        times = {e.key: e.self_device_time_total for e in events}
        is_gemm = [k for k in times if any(w in k.lower() for w in _GPU_GEMM_WORDS)]
        sort = "self_device_time_total"
    else:
        times = {e.key: e.self_cpu_time_total for e in events}
        is_gemm = [k for k in times if k.startswith(_GEMM_OPS)]
        sort = "self_cpu_time_total"
    total = sum(times.values()) or 1.0
    share = sum(times[k] for k in is_gemm) / total
    table = events.table(sort_by=sort, row_limit=12, max_name_column_width=48)
    head = f"one engine step: {len(seqs)} sequences, {batch.num_tokens} tokens\n"
    return share, head + table


def explain(value: float, gemm_share: float, target: float, vocab_size: int) -> str:
    """The ratio as (share of time in matmuls) x (their speed relative to torch.mm)."""
    inside = value / gemm_share if gemm_share else float("nan")
    return (
        f"{gemm_share:.0%} of the step's op time is in matmul / attention kernels; "
        f"the rest (norms, RoPE, SiLU, log-softmax and top-k over the {vocab_size}-entry "
        f"vocabulary, copies) does few FLOPs. Inside the matmul kernels the model runs at "
        f"about {inside:.2f} of the torch.mm rate (smaller, skinnier matrices than the "
        f"reference square). Reaching {target:g} needs both shares higher: "
        f"{target / max(gemm_share, 1e-9):.2f} of torch.mm inside the kernels at this share."
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--num-sequences", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    common.quiet_logs()
    common.check_device(args.device)
    engine = common.create_engine(args.device)
    try:
        workloads = common.make_workloads(args.num_sequences, args.seed, engine.info().vocab_size)
        common.engine_pass(engine, workloads[0], args.max_tokens)  # warm-up
        for workload in workloads:
            result, (rate, _) = bracketed_engine_pass(
                engine, workload, args.max_tokens, args.device
            )
            model = achieved(engine, workload, result.seconds)
            print(
                f"{workload.name}: model {model / 1e9:.1f} GFLOP/s, torch.mm "
                f"{rate / 1e9:.1f} GFLOP/s -> {model / rate:.3f}"
            )
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()

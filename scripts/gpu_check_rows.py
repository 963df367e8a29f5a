"""The versions and performance rows of ``scripts/gpu_check.py``.

* versions: Python, torch / CUDA / GPU, megatron-core, TransformerEngine,
  megatron-bridge, transformers, ``HAVE_TE``, ``HAVE_BRIDGE`` (INFO rows), a WARN row when
  TransformerEngine is absent (every row then runs the torch backend);
* start-up of ``megascore serve --model bench-8b`` (Llama-3-8B's shape, random weights);
* host syncs: host reads of device values inside the decoder layers of one engine step,
  per layer (FAIL above ``SYNCS_PER_LAYER``), and those of the rest of the step;
* tokens/s and MFU of ``bench`` and ``bench-8b`` (model FLOP/s over the GPU's dense
  bfloat16 peak, and over a measured ``torch.mm``);
* shared prefixes vs dense (``scripts/gpu_prefix_sharing.py``) on ``bench-8b`` / ``bench``;
* the prefix cache vs none, turn by turn (``scripts/gpu_prefix_sharing.py``) on ``bench``.

Each function takes the :class:`gpu_check.RowContext` and returns ``(result, detail)``
(or emits its rows itself and returns None).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIG = "bench-8b"
NOT_ON_CPU = f"{BIG} needs 32 GB in float32 on the CPU: run on a GPU (16 GB bf16)"
# A decoder layer of the torch backend reads no device value on the host (RoPE and the
# attention's boundaries are host tensors: docs/engine.md); above this a row fails.
SYNCS_PER_LAYER = 0.5
# Dense bfloat16 peak FLOP/s (no sparsity) by a word of torch.cuda.get_device_name().
BF16_PEAK = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
)


def _version(module: str) -> str:
    try:
        mod = __import__(module, fromlist=["__version__"])
    except Exception as e:  # noqa: BLE001 - TE / the bridge fail in many ways without CUDA
        return f"absent ({type(e).__name__})"
    return str(getattr(mod, "__version__", "?"))


def versions(ctx) -> None:
    """INFO rows, and the WARN row of an absent TransformerEngine."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
    ctx.emit("python", "INFO", 0.0, sys.version.split()[0])
    ctx.emit("torch", "INFO", 0.0, f"{torch.__version__} (CUDA {torch.version.cuda}) {gpu}")
    for name, module in (
        ("megatron-core", "megatron.core"),
        ("transformer-engine", "transformer_engine"),
        ("transformers", "transformers"),
    ):
        ctx.emit(name, "INFO", 0.0, _version(module))
    from megascore.checkpoint.hf_bridge import have_bridge, import_auto_bridge
    from megascore.model.build import HAVE_TE

    why = import_auto_bridge()[1]
    bridge = f"absent ({why})" if why else _version("megatron.bridge.package_info")
    ctx.emit("megatron-bridge", "INFO", 0.0, bridge)
    ctx.emit("HAVE_TE", "INFO", 0.0, str(HAVE_TE))
    ctx.emit("HAVE_BRIDGE", "INFO", 0.0, str(have_bridge()))
    if not HAVE_TE:
        ctx.emit(
            "TransformerEngine", "WARN", 0.0,
            "absent: TE attention, fused RoPE and grouped-GEMM experts are not checked; "
            "every row runs the torch backend",
        )  # fmt: skip


def bench_common():
    """bench/common.py (the benchmarks' engine, workloads and FLOP counts)."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    import common

    common.quiet_logs()
    common.single_rank_env()
    return common


def startup(ctx) -> tuple[str, str]:
    """``megascore serve --model bench-8b``: seconds from start to SERVING."""
    if ctx.device != "cuda":
        return "SKIP", NOT_ON_CPU
    from gpu_check_serve import Served

    with Served(BIG, "cuda", "bfloat16", ctx.out / "serve_8b.log") as server:
        seconds = server.wait_healthy(timeout=ctx.seconds)
        code = server.stop()
    if code != 0:
        return "FAIL", f"server exited {code} after SIGTERM"
    return "PASS", f"start -> SERVING {seconds:.1f} s (random weights, bfloat16)"


def _peak(device: str) -> tuple[float, str]:
    import torch

    if device != "cuda":
        return 0.0, "CPU"
    name = torch.cuda.get_device_name(0)
    return next((peak for word, peak in BF16_PEAK if word in name), 0.0), name


def throughput(model: str, device: str) -> tuple[str, str]:
    """tokens/s and MFU of the in-process engine on the rollout workload (one rank)."""
    common = bench_common()
    max_tokens = 16384 if device == "cuda" else 1024
    engine = common.create_engine(device, model)
    try:
        info = engine.info()
        workload = common.make_workloads(16 if device == "cuda" else 4, 0, info.vocab_size)[0]
        common.engine_pass(engine, workload, max_tokens)  # warm-up
        result = common.engine_pass(engine, workload, max_tokens)
        flops = common.model_flops(engine.loaded.config, info.num_parameters, workload.lengths)
    finally:
        engine.shutdown()
    tokens = int(workload.lengths.sum())
    rate = flops / result.seconds
    mm = common.matmul_flops_per_s(device, 8192 if device == "cuda" else 2048, 5)[0]
    peak, name = _peak(device)
    vs_peak = f"MFU {rate / peak:.3f} of {name} bf16 peak" if peak else f"no peak known for {name}"
    detail = (
        f"{tokens / result.seconds:,.0f} tokens/s ({tokens} tokens); {rate / 1e12:.2f} TFLOP/s; "
        f"{vs_peak}; {rate / mm:.3f} of torch.mm"
    )
    return "PASS", detail


def throughput_bench(ctx) -> tuple[str, str]:
    return throughput("bench", ctx.device)


def throughput_8b(ctx) -> tuple[str, str]:
    return throughput(BIG, ctx.device) if ctx.device == "cuda" else ("SKIP", NOT_ON_CPU)


def prefix_bench(ctx) -> tuple[str, str]:
    import gpu_prefix_sharing

    bench_common()
    return gpu_prefix_sharing.prefix_sharing("bench", ctx.device, ctx.dtype)


def prefix_8b(ctx) -> tuple[str, str]:
    if ctx.device != "cuda":
        return "SKIP", NOT_ON_CPU
    import gpu_prefix_sharing

    bench_common()
    return gpu_prefix_sharing.prefix_sharing(BIG, "cuda", "bfloat16")


def prefix_cache_bench(ctx) -> tuple[str, str]:
    import gpu_prefix_sharing

    bench_common()
    return gpu_prefix_sharing.prefix_cache("bench", ctx.device, ctx.dtype)


# Ops that read a device value on the host (each a sync on a GPU), and copies to the host.
_READ_OPS = frozenset(("_local_scalar_dense", "nonzero", "equal", "is_nonzero", "_unique2"))


def host_reads(device_type: str):
    """A dispatch mode counting host reads of ``device_type`` tensors, inside decoder
    layers (:meth:`HostReads.watch`) or outside them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    def on_device(x) -> bool:
        return hasattr(x, "device") and x.device.type == device_type

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.depth = 0
            self.counts: Counter = Counter()

        def watch(self, layers) -> list:
            pre = [m.register_forward_pre_hook(lambda *_: self._enter(1)) for m in layers]
            return pre + [m.register_forward_hook(lambda *_: self._enter(-1)) for m in layers]

        def _enter(self, step: int) -> None:
            self.depth += step

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            to_host = name == "_to_copy" and str(kwargs.get("device", "")) == "cpu"
            to_host |= name == "copy_" and args[0].device.type == "cpu"
            src = args[1] if name == "copy_" else args[0] if args else None
            if (name in _READ_OPS or to_host) and on_device(src):
                self.counts["layer" if self.depth else "step", name] += 1
            return func(*args, **kwargs)

    return HostReads()


def judge_syncs(counts: Counter, layers: int, device: str) -> tuple[str, str]:
    """The host-syncs row from the counted reads: FAIL above ``SYNCS_PER_LAYER`` on a GPU
    (on the CPU every tensor is a host tensor: counted, not judged)."""
    in_layers = sum(n for (where, _), n in counts.items() if where == "layer")
    step = sum(n for (where, _), n in counts.items() if where == "step")
    ops = ", ".join(f"{where} {op} {n}" for (where, op), n in sorted(counts.items())) or "none"
    per_layer = in_layers / layers
    detail = (
        f"{per_layer:.2f} host reads per decoder layer ({in_layers} in {layers} layers; "
        f"limit {SYNCS_PER_LAYER}), {step} in the rest of the step: {ops}"
    )
    if device != "cuda":
        return "INFO", f"CPU, not judged: {detail}"
    return ("PASS" if per_layer <= SYNCS_PER_LAYER else "FAIL"), detail


def host_syncs(ctx) -> tuple[str, str]:
    """Host reads of device values in one engine step of 8 sequences (bench; tiny on the
    CPU), per decoder layer; on a GPU also the blocking CUDA calls (torch.profiler)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.profiler import ProfilerActivity, profile

    common = bench_common()
    engine = common.create_engine(ctx.device, "bench" if ctx.device == "cuda" else "tiny")
    try:
        info = engine.info()
        workload = common.make_workloads(8, 0, info.vocab_size)[0]
        limit = info.max_sequence_length
        batch = common.score_batch([seq[:limit] for seq in workload.sequences[:8]])
        engine.score(batch)  # warm-up
        model = engine.loaded.model
        layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
        reads = host_reads(ctx.device)
        handles = reads.watch(layers)
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=activities if ctx.device == "cuda" else activities[:1]) as prof:
            with reads:
                engine.score(batch)
            common.synchronize(ctx.device)
        for handle in handles:
            handle.remove()
    finally:
        engine.shutdown()
    result, detail = judge_syncs(reads.counts, len(layers), ctx.device)
    blocking = sum(e.count for e in prof.key_averages() if e.key.endswith("Synchronize"))
    if ctx.device == "cuda":
        detail += f"; {blocking} blocking CUDA calls in the step (torch.profiler)"
    return result, f"{info.name}, 8 sequences: {detail}"

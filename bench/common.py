"""Helpers shared by the benchmarks in ``bench/`` (one place; import from here).

* workloads: the seeded RL-rollout length mix (log-normal, clipped to
  ``[16, 2048]``) and its uniform-length control, cut into token-budget batches;
* the in-process engine of one rank (``DistributedEngine`` on a world of 1);
* the machine description written at the top of ``bench/RESULTS.md``;
* FLOP accounting of the served model and the measured ``torch.mm`` rate;
* the reverse weight mapping Megatron ``GPTModel`` -> ``transformers``
  ``LlamaForCausalLM`` (the checkpoint package maps HF -> Megatron only);
* short profiles (``torch.profiler`` top ops, ``cProfile`` top functions)
  printed into the results where a target is missed.

Peak-memory and line-fit helpers come from ``bench/packed_forward.py`` (same
definitions in every benchmark). Scripts in ``bench/`` run as
``python bench/NAME.py``, so this directory is on ``sys.path`` and they import
``common`` directly.
"""

from __future__ import annotations

import cProfile
import dataclasses
import datetime
import io
import logging
import os
import platform
import pstats
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from packed_forward import PeakMemory, linear_fit, token_budget_batches

logger = logging.getLogger(__name__)

# Re-exported: the other benchmarks take these from here, like everything shared.
__all__ = ["PeakMemory", "linear_fit", "token_budget_batches"]

MODEL = "bench"
MEDIAN, SIGMA = 400.0, 0.8  # the rollout mix: log-normal lengths, clipped to [16, 2048]
TOP_K = 5
LOSSES = ("nll",)


# ---- process set-up -------------------------------------------------------------------------


def single_rank_env() -> None:
    """Environment of a one-rank torch.distributed job (the engine's default group)."""
    from megascore_server.ports import pick_port

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_PORT", str(pick_port()))


def quiet_logs() -> None:
    """Keeps Megatron's and transformers' import chatter out of the benchmark output."""
    import warnings

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("megatron", "megatron.core", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def dtype_name(device: str) -> str:
    """The benchmark dtype: fp32 on the CPU, bf16 on a GPU."""
    return "bfloat16" if device == "cuda" else "float32"


def check_device(device: str) -> None:
    """Fails early (before any subprocess starts) when ``--device cuda`` has no GPU."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch.cuda.is_available() is False on this machine")


def create_engine(device: str, model: str = MODEL):
    """The in-process engine of one rank, as ``megascore serve --model bench`` builds it.

    Args:
        device: "cpu" or "cuda" ("auto" attention backend: TE on a GPU when importable).
        model: the model string (default: the ``bench`` built-in).

    Returns:
        A ``DistributedEngine`` (call ``shutdown()`` when done).
    """
    single_rank_env()
    from megascore.config import EngineConfig
    from megascore.engine.runtime import DistributedEngine

    return DistributedEngine.create(
        # prefix_cache=False: the passes resend the same sequences (measure their computation)
        EngineConfig(model=model, device=device, dtype=dtype_name(device), prefix_cache=False)
    )


def synchronize(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


# ---- workloads ------------------------------------------------------------------------------


@dataclasses.dataclass
class Workload:
    """A list of token sequences in arrival order.

    Attributes:
        name: "rollout" (log-normal mix) or "uniform" (control).
        sequences: int64 token ids per sequence.
        description: how the lengths were drawn.
    """

    name: str
    sequences: list[np.ndarray]
    description: str

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(s) for s in self.sequences], dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def batches(self, max_tokens: int) -> list[list[int]]:
        """Sequence indices per engine step / request: greedy in arrival order."""
        return token_budget_batches(self.lengths, max_tokens)

    def subset(self, indices: list[int]) -> Workload:
        """The sequences ``indices`` (in that order) as a workload of their own."""
        return Workload(self.name, [self.sequences[i] for i in indices], self.description)

    def summary(self) -> str:
        lens = self.lengths
        return (
            f"{len(lens)} sequences, {int(lens.sum())} tokens, length min {lens.min()} "
            f"median {int(np.median(lens))} mean {lens.mean():.0f} max {lens.max()}"
        )


def rollout_lengths(
    num: int, seed: int, *, median: float, sigma: float, min_len: int = 16, max_len: int = 2048
) -> np.ndarray:
    """Prompt + response lengths of RL rollouts: seeded log-normal clipped to [min, max]."""
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(np.log(median), sigma, num)
    return np.clip(np.round(raw), min_len, max_len).astype(np.int64)


def make_workloads(
    num: int,
    seed: int,
    vocab_size: int,
    *,
    median: float = MEDIAN,
    sigma: float = SIGMA,
    max_len: int = 2048,
    num_uniform: int | None = None,
) -> tuple[Workload, Workload]:
    """The rollout mix of ``num`` sequences and its uniform-length control.

    The control has ``num_uniform`` (default ``num``) sequences of the mix's mean length.

    Returns:
        ``(rollout, uniform)``.
    """
    lengths = rollout_lengths(num, seed, median=median, sigma=sigma, max_len=max_len)
    rng = np.random.default_rng(seed + 1)
    rollout = Workload(
        "rollout",
        [rng.integers(0, vocab_size, int(n)).astype(np.int64) for n in lengths],
        f"log-normal(median {median:g}, sigma {sigma:g}) clipped to [16, {max_len}], seed {seed}",
    )
    uniform_len = int(round(lengths.mean()))
    uniform = Workload(
        "uniform",
        [
            rng.integers(0, vocab_size, uniform_len).astype(np.int64)
            for _ in range(num if num_uniform is None else num_uniform)
        ],
        f"every sequence {uniform_len} tokens (the mix's mean length), seed {seed + 1}",
    )
    return rollout, uniform


def warmup_sequences(workload: Workload) -> list[np.ndarray]:
    """The warm-up batch of both the in-process engine and the server: 4 x <= 256 tokens."""
    return [seq[:256] for seq in workload.sequences[:4]]


def score_batch(sequences: list[np.ndarray]):
    """The benchmark request: logprobs, top-5 alternatives and the summed NLL."""
    from megascore.api.types import ScoreBatch

    return ScoreBatch(
        token_ids=np.concatenate(sequences),
        lengths=np.array([len(s) for s in sequences], dtype=np.int64),
        top_k=TOP_K,
        losses=LOSSES,
    )


@dataclasses.dataclass
class Pass:
    """One timed pass over a workload.

    Attributes:
        seconds: wall-clock time.
        cpu_seconds: CPU time of this process (all its threads) over the same interval;
            on a shared machine it barely moves with the load, unlike ``seconds``.
        logprobs: per-sequence logprobs, in workload order.
    """

    seconds: float
    cpu_seconds: float
    logprobs: list[np.ndarray]


def engine_pass(engine, workload: Workload, max_tokens: int) -> Pass:
    """Scores the workload in token-budget batches with the in-process engine."""
    out: list[np.ndarray | None] = [None] * len(workload.sequences)
    seqs = workload.sequences
    cpu, start = time.process_time(), time.perf_counter()
    for idx in workload.batches(max_tokens):
        res = engine.score(score_batch([seqs[i] for i in idx]))
        parts = np.split(res.logprobs, np.cumsum([len(seqs[i]) for i in idx])[:-1])
        for i, lp in zip(idx, parts, strict=True):
            out[i] = lp
    return Pass(time.perf_counter() - start, time.process_time() - cpu, out)


def write_section(path, begin: str, end: str, section: str) -> None:
    """Writes ``section`` (from ``begin`` through ``end``) into ``path``: replaces the
    text between the markers when present, else appends it. A benchmark that keeps its
    own section of RESULTS.md (``run_all.py`` carries such sections over) uses this."""
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section.rstrip("\n") + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    path.write_text(text)


def run_own_section(
    prefix: str,
    markers: tuple[str, str],
    output,
    measure: Callable[[Path], dict],
    section: Callable[[dict, dict, float], str],
) -> None:
    """The main of a benchmark that keeps its own section of RESULTS.md: ``measure(tmp)``
    in a temporary directory, then ``section(results, machine, elapsed_s)`` written
    between ``markers`` of ``output`` and printed."""
    machine = machine_info("cpu")
    start = time.time()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        res = measure(Path(tmp))
    text = section(res, machine, time.time() - start)
    write_section(output, *markers, text)
    print(text)


# ---- machine --------------------------------------------------------------------------------


def load_average() -> str:
    """The 1 / 5 / 15-minute load averages, as the sections print them."""
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str) -> dict[str, str]:
    """What the run measured on (written at the top of RESULTS.md)."""
    import google.protobuf
    import grpc
    import torch

    try:
        import megatron.core as mcore

        mcore_version = mcore.__version__
    except Exception:  # noqa: BLE001 - reported, not needed
        mcore_version = "not importable"
    try:
        import transformers

        hf_version = transformers.__version__
    except ImportError:
        hf_version = "not installed"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "cpu": f"{cpu_model()} ({cores} cores usable, {os.cpu_count()} online)",
        "load average": load_average(),
        "python": platform.python_version(),
        "torch": f"{torch.__version__} ({torch.get_num_threads()} intra-op threads)",
        "megatron-core": mcore_version,
        "transformers": hf_version,
        "grpcio / protobuf": f"{grpc.__version__} / {google.protobuf.__version__}",
        "numpy": np.__version__,
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = (
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"
        )
    return info


# ---- FLOPs ----------------------------------------------------------------------------------


def matmul_flops_per_s(device: str, n: int, calls: int) -> tuple[float, float]:
    """Dense ``torch.mm`` rate of two ``[n, n]`` matrices in the benchmark dtype.

    Returns:
        ``(wall rate, CPU-time rate)``: the median over ``calls`` timed calls (after a
        warm-up) of ``2 n^3`` over the wall time, and over the process CPU time divided
        by the intra-op threads (0 on a GPU). On a shared machine the median is the
        typical rate, comparable with an engine pass that also averages over load.
    """
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device, dtype)
    b = torch.randn(n, n, generator=gen).to(device, dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up
    synchronize(device)
    inner = 10 if device == "cuda" else 1
    threads = torch.get_num_threads()
    wall, cpu = [], []
    for _ in range(calls):
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b, out=out)
        synchronize(device)
        flops = 2.0 * n**3 * inner
        wall.append(flops / (time.perf_counter() - t0))
        cpu.append(flops / max((time.process_time() - c0) / threads, 1e-9))
    return float(np.median(wall)), (float(np.median(cpu)) if device == "cpu" else 0.0)


def matmul_params(model_cfg, num_parameters: int) -> int:
    """Parameters that take part in a matmul per token: all but the input embedding table."""
    return num_parameters - model_cfg.vocab_size * model_cfg.hidden_size


def model_flops(model_cfg, num_parameters: int, lengths: np.ndarray) -> float:
    """Forward FLOPs of scoring sequences of ``lengths``: weights plus causal attention.

    ``2 * matmul_params * tokens`` plus, per layer and sequence of length L,
    ``2 * 2 * heads * head_dim * L (L + 1) / 2`` for ``Q K^T`` and ``P V`` over the
    causal (lower-triangle) pairs only.
    """
    lengths = np.asarray(lengths, dtype=np.float64)
    dense = 2.0 * matmul_params(model_cfg, num_parameters) * float(lengths.sum())
    attn_dim = model_cfg.num_attention_heads * model_cfg.kv_channels
    attention = 2.0 * attn_dim * model_cfg.num_layers * float((lengths * (lengths + 1)).sum())
    return dense + attention


# ---- Megatron -> transformers ---------------------------------------------------------------


def hf_llama_config(model_cfg, dtype):
    """``transformers.LlamaConfig`` of a dense Llama-style :class:`ModelConfig`."""
    import transformers

    unsupported = [
        what
        for what, bad in (
            ("MoE", model_cfg.is_moe),
            ("MTP", model_cfg.has_mtp),
            ("LayerNorm", model_cfg.normalization != "RMSNorm"),
            ("non-SwiGLU MLP", not model_cfg.gated_linear_unit or model_cfg.activation != "silu"),
            ("biases", model_cfg.add_bias_linear or model_cfg.add_qkv_bias),
            ("qk layernorm", model_cfg.qk_layernorm),
            ("non-RoPE positions", model_cfg.position_embedding_type != "rope"),
            ("partial / scaled RoPE", model_cfg.rotary_percent != 1.0 or model_cfg.rope_scaling),
        )
        if bad
    ]
    if unsupported:
        raise ValueError(f"no Llama equivalent for: {', '.join(unsupported)}")
    return transformers.LlamaConfig(
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.ffn_hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_query_groups,
        head_dim=model_cfg.kv_channels,
        max_position_embeddings=model_cfg.max_position_embeddings,
        rms_norm_eps=model_cfg.layernorm_epsilon,
        rope_theta=model_cfg.rotary_base,
        tie_word_embeddings=model_cfg.share_embeddings_and_output_weights,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        torch_dtype=dtype,
    )


def megatron_to_hf_state_dict(megatron_state: dict, model_cfg) -> dict:
    """HF Llama tensors from a TP=1 Megatron GPTModel state dict (local or TE layer spec).

    The inverse of ``megascore.checkpoint.hf_weights``: ``linear_qkv`` is fused per
    query group (``[ng, nh/ng + 2, d, h]``: the group's query heads, its key head,
    its value head); ``linear_fc1`` of the SwiGLU MLP is ``[gate; up]``.
    """
    h, d = model_cfg.hidden_size, model_cfg.kv_channels
    nh, ng, v = model_cfg.num_attention_heads, model_cfg.num_query_groups, model_cfg.vocab_size
    f = model_cfg.ffn_hidden_size
    sd = {k: t for k, t in megatron_state.items() if not k.endswith("_extra_state")}

    def pick(*names: str):
        for name in names:
            if name in sd:
                return sd.pop(name)
        raise KeyError(f"none of {names} in the Megatron state dict")

    out = {
        "model.embed_tokens.weight": pick("embedding.word_embeddings.weight")[:v],
        "model.norm.weight": pick("decoder.final_layernorm.weight"),
    }
    if not model_cfg.share_embeddings_and_output_weights:
        out["lm_head.weight"] = pick("output_layer.weight")[:v]
    for i in range(model_cfg.num_layers):
        m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = pick(
            m + "input_layernorm.weight", m + "self_attention.linear_qkv.layer_norm_weight"
        )
        out[p + "post_attention_layernorm.weight"] = pick(
            m + "pre_mlp_layernorm.weight", m + "mlp.linear_fc1.layer_norm_weight"
        )
        # qkv: [ng * (nh/ng + 2) * d, h] -> [ng, nh/ng + 2, d, h]
        qkv = pick(m + "self_attention.linear_qkv.weight").view(ng, nh // ng + 2, d, h)
        out[p + "self_attn.q_proj.weight"] = qkv[:, : nh // ng].reshape(nh * d, h)
        out[p + "self_attn.k_proj.weight"] = qkv[:, -2].reshape(ng * d, h)
        out[p + "self_attn.v_proj.weight"] = qkv[:, -1].reshape(ng * d, h)
        out[p + "self_attn.o_proj.weight"] = pick(m + "self_attention.linear_proj.weight")
        fc1 = pick(m + "mlp.linear_fc1.weight")  # [2f, h] = [gate; up]
        out[p + "mlp.gate_proj.weight"] = fc1[:f]
        out[p + "mlp.up_proj.weight"] = fc1[f:]
        out[p + "mlp.down_proj.weight"] = pick(m + "mlp.linear_fc2.weight")
    if sd:
        raise KeyError(f"Megatron tensors without an HF mapping: {sorted(sd)[:5]}")
    return {k: t.contiguous() for k, t in out.items()}


def hf_llama_from_engine(engine):
    """A ``LlamaForCausalLM`` (SDPA attention, eval mode) with the engine's weights.

    Only for a TP = 1 replica of a dense Llama-style model; same device and dtype.
    """
    import torch
    import transformers

    model = engine.loaded.model
    model_cfg = engine.loaded.config
    param = next(model.parameters())
    config = hf_llama_config(model_cfg, param.dtype)
    config._attn_implementation = "sdpa"
    with torch.device(param.device):
        hf = transformers.LlamaForCausalLM(config).to(param.dtype)
    state = megatron_to_hf_state_dict(model.state_dict(), model_cfg)
    hf.load_state_dict(state, strict=True)
    return hf.eval().requires_grad_(False)


# ---- profiles -------------------------------------------------------------------------------


def torch_profile(fn: Callable[[], object], device: str, top: int = 12) -> str:
    """``torch.profiler`` table of the ``top`` ops by self time of one call of ``fn``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    sort = "self_cpu_time_total"
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
        sort = "self_device_time_total"
    with profile(activities=activities) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by=sort, row_limit=top, max_name_column_width=48)


def python_profile(fn: Callable[[], object], top: int = 15) -> str:
    """``cProfile`` of one call of ``fn``: the ``top`` functions by cumulative time."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("cumulative").print_stats(top)
    text = buf.getvalue()
    start = text.find("   ncalls")
    return text[start:].rstrip() if start >= 0 else text.rstrip()


# ---- results --------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    """One line of the results table.

    Attributes:
        number: measurement number ("1", "2a", ...).
        measurement: what the ratio is.
        workload: "rollout", "uniform" or a description.
        value: the measured ratio.
        detail: the two sides of the ratio, in words.
        target: the threshold, or None for a control row.
        higher_is_better: whether the target is a minimum (True) or a maximum.
        why: on a miss, the factors of the ratio (markdown).
        profile: on a miss, a short profile (preformatted text).
        caveat: why the verdict may not carry over (e.g. a workload too small).
    """

    number: str
    measurement: str
    workload: str
    value: float
    detail: str
    target: float | None = None
    higher_is_better: bool = True
    why: str = ""
    profile: str = ""
    caveat: str = ""

    @property
    def passed(self) -> bool | None:
        if self.target is None:
            return None
        return self.value >= self.target if self.higher_is_better else self.value <= self.target

    def target_text(self) -> str:
        if self.target is None:
            return "control"
        return f"{'>=' if self.higher_is_better else '<='} {self.target:g}"

    def result_text(self) -> str:
        if self.passed is None:
            return "-"
        return "pass" if self.passed else f"**miss** ({self.shortfall()})"

    def shortfall(self) -> str:
        """How far from the target, e.g. "0.12 below, 6% short"."""
        gap = abs(self.value - self.target)
        rel = gap / self.target if self.target else float("inf")
        side = "below" if self.higher_is_better else "above"
        return f"{gap:.3g} {side}, {rel:.0%} off"

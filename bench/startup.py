"""Start-up and LoadWeights of a ~1B-parameter HF checkpoint: time and peak memory, one run.

``python bench/startup.py [--reps 3]`` writes its section of ``bench/RESULTS.md``
(between the ``startup.py`` markers; ``run_all.py`` keeps it).

A random Llama-3.2-1B-shaped checkpoint (hidden 2048, 16 layers, 32 query / 8 KV
heads, MLP 8192, vocabulary 128256, tied embeddings: 1.24B parameters) is written as
bf16 safetensors (2 files and an index, as the hub stores it) to a temporary directory,
then, per repetition, side by side:

* ``megascore serve --model tiny`` and ``megascore serve --model hf:DIR --dtype
  bfloat16`` on the CPU (one process each), each timed from the spawn to the first
  SERVING health answer (polled every 20 ms); the process's peak RSS (``VmHWM``) is
  read at that moment;
* ``LoadWeights hf:DIR`` into the running hf server: its peak RSS is reset through
  ``/proc/PID/clear_refs`` first, so the peak is the reload's.

Definitions (docs/benchmarks.md): load phase = start -> healthy of the hf server minus
that of the tiny one, also timed inside the servers (the engine's ``built and loaded
in`` log line, hf minus tiny: the judged figure), seconds per GiB of checkpoint
(target <= 1.0); the peak RSS of the hf server above the tiny one's over the
checkpoint's bytes (target <= 1.3); the LoadWeights peak RSS over the serving process's
RSS before it (target <= 1.5).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import common

from megascore_server import procfs

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- startup.py: begin -->", "<!-- startup.py: end -->"
GIB = 2**30
_BUILT = re.compile(r"built and loaded in ([0-9.]+) s")  # the engine's start-up log line
TARGET_S_PER_GIB = 1.0
TARGET_RSS_STARTUP = 1.3
TARGET_RSS_RELOAD = 1.5
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}


def _layer_tensors(i: int) -> dict[str, tuple[int, ...]]:
    c = CONFIG
    h, f, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    p = f"model.layers.{i}."
    return {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, q),
        p + "mlp.gate_proj.weight": (f, h),
        p + "mlp.up_proj.weight": (f, h),
        p + "mlp.down_proj.weight": (h, f),
    }


def write_checkpoint(directory: Path) -> tuple[int, int]:
    """Writes the random bf16 checkpoint; returns (parameters, bytes of the weight files)."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2))
    layers = CONFIG["num_hidden_layers"]
    h = CONFIG["hidden_size"]
    files = [
        {"model.embed_tokens.weight": (CONFIG["vocab_size"], h)},
        {"model.norm.weight": (h,)},
    ]
    for i in range(layers):
        files[0 if i < layers // 2 else 1].update(_layer_tensors(i))
    gen = torch.Generator().manual_seed(0)
    weight_map, params = {}, 0
    for k, shapes in enumerate(files):
        name = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        tensors = {}
        for tensor, shape in shapes.items():
            value = torch.empty(shape, dtype=torch.bfloat16)
            if len(shape) == 1:
                value.fill_(1.0)
            else:
                value.normal_(0.0, 0.02, generator=gen)
            tensors[tensor] = value
            weight_map[tensor] = name
            params += value.numel()
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    size = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    return params, size


class Server:
    """One ``megascore serve`` subprocess on the CPU, timed from spawn to SERVING."""

    def __init__(self, model: str, log: Path, dtype: str = "float32"):
        from megascore_client import ScoringClient
        from megascore_server.serve_process import ServeProcess

        flags = ["--model", model, "--device", "cpu", "--dtype", dtype, "--grace-s", "2"]
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        # health polled every 20 ms from the spawn: serving_s is spawn -> first SERVING
        self.server = ServeProcess(log, *flags, env=env, poll_s=0.02)
        self.pid = self.server.pid
        self.client = ScoringClient(self.server.target, timeout=600)
        try:
            self.server.wait_serving(timeout=600)
        except BaseException:
            self.stop()
            raise
        self.startup_s = self.server.serving_s
        self.startup_cpu_s = procfs.cpu_seconds(self.pid)
        self.peak_rss = procfs.status_kib(self.pid, "VmHWM") * 1024
        found = _BUILT.search(log.read_text())
        if found is None:
            self.stop()
            raise RuntimeError(f"no 'built and loaded in' line in {log}")
        self.built_s = float(found.group(1))

    def rss(self) -> int:
        return procfs.rss_kb(self.pid) * 1024

    def load_weights(self, model: str) -> tuple[float, int, int]:
        """LoadWeights; returns (seconds, RSS before, peak RSS during)."""
        procfs.reset_peak_rss(self.pid)  # VmHWM := the current RSS
        before = self.rss()
        start = time.perf_counter()
        self.client.load_weights(model)
        seconds = time.perf_counter() - start
        return seconds, before, procfs.status_kib(self.pid, "VmHWM") * 1024

    def stop(self) -> None:
        self.client.close()
        self.server.stop(grace=60)


def measure(reps: int, workdir: Path) -> dict:
    ckpt = workdir / "llama-1b"
    start = time.perf_counter()
    params, size = write_checkpoint(ckpt)
    took = time.perf_counter() - start
    log(f"wrote {params / 1e9:.2f}B parameters, {size / GIB:.2f} GiB in {took:.0f} s")
    res: dict = {"params": params, "bytes": size, "reps": []}
    for rep in range(reps):
        tiny = Server("tiny", workdir / f"tiny-{rep}.log")
        tiny.stop()
        hf = Server(f"hf:{ckpt}", workdir / f"hf-{rep}.log", dtype="bfloat16")
        try:
            reload_s, before, reload_peak = hf.load_weights(f"hf:{ckpt}")
            hf.client.score([list(range(1, 33))])  # still serving after the reload
        finally:
            hf.stop()
        row = {
            "tiny_s": tiny.startup_s,
            "tiny_built_s": tiny.built_s,
            "tiny_cpu_s": tiny.startup_cpu_s,
            "tiny_peak": tiny.peak_rss,
            "hf_s": hf.startup_s,
            "hf_built_s": hf.built_s,
            "hf_cpu_s": hf.startup_cpu_s,
            "hf_peak": hf.peak_rss,
            "reload_s": reload_s,
            "serving_rss": before,
            "reload_peak": reload_peak,
        }
        res["reps"].append(row)
        log(
            f"rep {rep}: tiny {tiny.startup_s:.2f} s, hf {hf.startup_s:.2f} s, "
            f"peak {hf.peak_rss / GIB:.2f} vs {tiny.peak_rss / GIB:.2f} GiB; LoadWeights "
            f"{reload_s:.2f} s, peak {reload_peak / GIB:.2f} GiB over {before / GIB:.2f} GiB"
        )
    res["load_end"] = common.machine_info("cpu")["load average"]
    return res


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def figures(res: dict) -> dict[str, list[float]]:
    """Per-repetition ratios (definitions in the module docstring)."""
    gib, size = res["bytes"] / GIB, res["bytes"]
    out: dict[str, list[float]] = {}
    for r in res["reps"]:
        load_s = r["hf_s"] - r["tiny_s"]
        out.setdefault("load_s", []).append(load_s)
        out.setdefault("s_per_gib", []).append(load_s / gib)
        built_s = r["hf_built_s"] - r["tiny_built_s"]
        out.setdefault("built_s_per_gib", []).append(built_s / gib)
        out.setdefault("cpu_s_per_gib", []).append((r["hf_cpu_s"] - r["tiny_cpu_s"]) / gib)
        out.setdefault("rss_above_tiny", []).append((r["hf_peak"] - r["tiny_peak"]) / size)
        out.setdefault("reload_s", []).append(r["reload_s"])
        out.setdefault("reload_ratio", []).append(r["reload_peak"] / r["serving_rss"])
        out.setdefault("reload_above", []).append((r["reload_peak"] - r["serving_rss"]) / size)
    return out


def section(res: dict, reps: int, machine: dict, elapsed: float) -> str:
    """The markdown section of RESULTS.md."""
    med = statistics.median
    fig = figures(res)
    runs = res["reps"]

    def spread(key: str, fmt: str = ".2f") -> str:
        return f"{med(fig[key]):{fmt}} ({min(fig[key]):{fmt}}..{max(fig[key]):{fmt}})"

    rows = [
        ("load phase (built + loaded, hf - tiny), s per GiB", "built_s_per_gib",
         f"<= {TARGET_S_PER_GIB}", med(fig["built_s_per_gib"]) <= TARGET_S_PER_GIB),
        ("start-up peak RSS above tiny's / checkpoint bytes", "rss_above_tiny",
         f"<= {TARGET_RSS_STARTUP}", med(fig["rss_above_tiny"]) <= TARGET_RSS_STARTUP),
        ("LoadWeights peak RSS / serving RSS before it", "reload_ratio",
         f"<= {TARGET_RSS_RELOAD}", med(fig["reload_ratio"]) <= TARGET_RSS_RELOAD),
    ]  # fmt: skip
    lines = [
        BEGIN,
        "## Start-up and LoadWeights of a 1B checkpoint (`bench/startup.py`)",
        "",
        f"Written by `python bench/startup.py --reps {reps}` in {elapsed / 60:.1f} min "
        f"({machine['date']}, load average {machine['load average']} at the start, "
        f"{res['load_end']} at the end); rerun it to update this section.",
        "",
        f"* checkpoint: random Llama-3.2-1B shape, {res['params'] / 1e9:.2f}B parameters, "
        f"bf16 safetensors in 2 files, {res['bytes'] / GIB:.2f} GiB (page cache warm)",
        "* `megascore serve --model tiny` and `--model hf:DIR --dtype bfloat16`, CPU, one "
        "process each, spawn -> first SERVING health answer; peak RSS = `VmHWM` then; "
        "then `LoadWeights hf:DIR` (same checkpoint) into the hf server, `VmHWM` reset "
        "before it",
        f"* {reps} repetitions; median (min..max)",
        "",
        "| rep | tiny start s | hf start s | load phase s | built + loaded s (tiny / hf) | "
        "load phase CPU s | tiny peak GiB | hf peak GiB | LoadWeights s | serving RSS GiB | "
        "LoadWeights peak GiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(runs):
        lines.append(
            f"| {i} | {r['tiny_s']:.2f} | {r['hf_s']:.2f} | {r['hf_s'] - r['tiny_s']:.2f} | "
            f"{r['tiny_built_s']:.2f} / {r['hf_built_s']:.2f} | "
            f"{r['hf_cpu_s'] - r['tiny_cpu_s']:.2f} | "
            f"{r['tiny_peak'] / GIB:.2f} | {r['hf_peak'] / GIB:.2f} | {r['reload_s']:.2f} | "
            f"{r['serving_rss'] / GIB:.2f} | {r['reload_peak'] / GIB:.2f} |"
        )
    lines += ["", "| figure | value | target | result |", "|---|---:|---|---|"]
    met = 0
    for label, key, target, ok in rows:
        met += ok
        lines.append(f"| {label} | {spread(key)} | {target} | {'pass' if ok else 'MISS'} |")
    lines += [
        f"| load phase (start -> SERVING, hf - tiny), s per GiB | {spread('s_per_gib')} | | |",
        f"| load phase, CPU s (user + system) per GiB | {spread('cpu_s_per_gib')} | | |",
        f"| LoadWeights peak RSS above serving / checkpoint bytes | {spread('reload_above')} | | |",
        f"| LoadWeights s per GiB | {med(fig['reload_s']) / (res['bytes'] / GIB):.2f} | | |",
        "",
        f"{met} of 3 targets met. Both servers of a repetition start back to back, so "
        "their difference is the load (the model build, reading and placing the weights); "
        "the imports and the gRPC start cost the same in both. On a shared machine the "
        "start -> SERVING times swing by far more than the load itself (the imports take "
        "tens of seconds under load), so the judged figure is the same difference timed "
        "inside the servers: the engine's `built and loaded in` seconds (building the "
        "model and loading or drawing its weights, every rank agreed), hf minus tiny. The "
        "CPU seconds (each server's user + system time at its first SERVING answer, hf "
        "minus tiny) say what the load costs without the wait for a core.",
        END,
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args()
    common.quiet_logs()
    common.run_own_section(
        "megascore-startup-bench-",
        (BEGIN, END),
        args.output,
        lambda workdir: measure(args.reps, workdir),
        lambda res, machine, elapsed: section(res, args.reps, machine, elapsed),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Runs every megascore benchmark side by side and writes ``bench/RESULTS.md``.

``python bench/run_all.py [--device cpu|cuda] [--quick]`` (start with ``--quick``:
minutes on 2 CPU cores; the full run uses more tokens and repetitions).

Every target is a ratio of two numbers measured in this one run, interleaved
per repetition so that a shared, noisy machine affects both sides alike:

1. e2e / engine: tokens/s through gRPC (``megascore serve`` subprocess, SDK
   client in another process) over tokens/s of the engine in-process, same
   batches (``e2e_vs_engine.py``). Target >= 0.90.
2. packed / padded: megascore tokens/s over ``transformers`` ``LlamaForCausalLM``
   (same weights, logprobs checked first) on padded batches of 8, in arrival
   order (target >= 2.0) and length-sorted (target >= 1.3) (``packed_vs_hf.py``).
3. model FLOP/s / measured ``torch.mm`` FLOP/s (``mfu.py``). Target >= 0.5 on CPU.
4. wire encode + decode of 1M tokens (logprobs, top-5) / time to score them
   (``wire_cost.py``). Target <= 0.05.
5. peak memory vs tokens per batch, 4 sizes in fresh processes: least-squares
   line, max residual <= 5 % of the largest step growth; R^2 reported (``memory.py``).

Targets apply to the RL-rollout length mix; the uniform-length rows are the
control. Where a target is missed, RESULTS.md says by how much, why (the
factors of the ratio) and prints a short profile. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import adapters
import batch_invariance
import common
import data_parallel
import e2e_vs_engine
import families_cpu
import http_front
import memory
import mfu
import option_cost
import packed_vs_hf
import pipeline
import prefix_cache
import prefix_grid
import prefix_sharing
import replica_scaling
import routing_cost
import single_sequence
import startup
import weight_push
import wire_cost
from common import Row

SOAK_SECTION = types.SimpleNamespace(  # written by scripts/soak.py --results (soak_report.py)
    BEGIN="<!-- soak.py --changing-weights: begin -->",
    END="<!-- soak.py --changing-weights: end -->",
)

logger = logging.getLogger("run_all")

HERE = Path(__file__).resolve().parent
E2E_TARGET, PADDED_TARGET, SORTED_TARGET, MFU_TARGET, WIRE_TARGET = 0.90, 2.0, 1.3, 0.5, 0.05


@dataclasses.dataclass
class Settings:
    """Sizes of one run (``--quick`` or full)."""

    rollout_sequences: int
    uniform_sequences: int
    reps: int
    max_tokens: int
    wire_tokens: int
    wire_repeats: int
    memory_sizes: list[int]
    memory_jobs: int


def settings(quick: bool) -> Settings:
    if quick:
        return Settings(16, 8, 1, 4096, 1_000_000, 2, [8192, 12288, 16384, 20480], 2)
    return Settings(48, 24, 2, 4096, 1_000_000, 5, [8192, 16384, 24576, 32768], 1)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def med(values) -> float:
    return float(statistics.median(values))


# ---- timing loop ----------------------------------------------------------------------------


def _group_pass(step, engine, hf, server, sub, cfg, device, workdir, rec, order) -> list:
    """Runs one side of a round on the group ``sub``; adds its times to ``rec``.

    Returns:
        The group's per-sequence logprobs.
    """
    if step == "engine":
        rate, rate_cpu = mfu.machine_rate(device, calls=3)
        rec["mm"].append(rate)
        rec["mm_cpu"].append(rate_cpu)
        result = common.engine_pass(engine, sub, cfg.max_tokens)
        key = "engine" if order == "arrival" else "engine_sorted"
    elif step == "hf":
        result = packed_vs_hf.hf_pass(hf, sub, "arrival", device)  # sub is one batch, in order
        key = f"hf_{order}"
    else:  # e2e: the group as 2 concurrent requests; the server merges them into its steps
        half = (len(sub.sequences) + 1) // 2
        requests = [list(range(half)), list(range(half, len(sub.sequences)))]
        summary, logprobs = e2e_vs_engine.e2e_pass(
            server, sub.sequences, [r for r in requests if r], workdir
        )
        rec["e2e_groups"].append(summary)
        return logprobs
    rec[key] += result.seconds
    rec[key + "_cpu"] += result.cpu_seconds
    return result.logprobs


def _merge_e2e(summaries: list[dict]) -> dict:
    merged = {k: sum(s[k] for s in summaries) for k in E2E_SUMS}
    merged["per_request"] = [r for s in summaries for r in s["per_request"]]
    return merged


E2E_SUMS = ("seconds", "engine_step_s", "engine_steps", "server_cpu_s", "client_cpu_s", "requests")


def timing_reps(engine, hf, server, workloads, cfg: Settings, device: str, workdir: Path) -> dict:
    """Paired rounds: each group of 8 sequences is scored by every side back to back.

    A round is one transformers batch: 8 sequences in arrival order (megascore
    in-process, e2e as 2 concurrent requests, transformers padded) or, for the
    rollout mix, 8 length-sorted sequences (megascore, transformers). The sides of
    a round run seconds apart, in an order that alternates from round to round, so
    the machine's load weighs on them alike; a side's time is the sum over rounds.
    ``torch.mm`` is timed right before every megascore run.

    Returns:
        Per workload name, lists over repetitions: wall seconds (``engine``,
        ``engine_sorted``, ``hf_arrival``, ``hf_sorted``), process CPU seconds (same keys
        + ``_cpu``), merged e2e summaries (``e2e``), median matmul FLOP/s (``mm``,
        ``mm_cpu``); and the max logprob differences ``diff_e2e``, ``diff_hf``.
    """
    keys = ("engine", "engine_sorted", "hf_arrival", "hf_sorted")
    keys += tuple(k + "_cpu" for k in keys) + ("e2e", "mm", "mm_cpu")
    out = {w.name: {k: [] for k in keys} for w in workloads}
    for rep in range(cfg.reps):
        for workload in workloads:
            rec = {k: 0.0 for k in keys[:8]} | {"e2e_groups": [], "mm": [], "mm_cpu": []}
            lps = {"engine": {}, "e2e": {}, "hf": {}}
            orders = ("arrival", "sorted") if workload.name == "rollout" else ("arrival",)
            for order in orders:
                idx = packed_vs_hf.batch_order(workload, order)
                groups = [idx[b : b + packed_vs_hf.BATCH_SIZE] for b in range(0, len(idx), 8)]
                for i, group in enumerate(groups):
                    sub = workload.subset(group)
                    steps = ["engine", "hf"] + (["e2e"] if order == "arrival" else [])
                    if (i + rep) % 2:
                        steps.reverse()
                    log(
                        f"rep {rep + 1}/{cfg.reps} {workload.name} {order} group {i + 1}/"
                        f"{len(groups)} ({sub.num_tokens} tokens): {', '.join(steps)}"
                    )
                    for step in steps:
                        got = _group_pass(
                            step, engine, hf, server, sub, cfg, device, workdir, rec, order
                        )
                        if order == "arrival":
                            lps[step].update(zip(group, got, strict=True))
            if len(orders) == 1:  # uniform lengths: sorted batches are the arrival batches
                rec["engine_sorted"], rec["hf_sorted"] = rec["engine"], rec["hf_arrival"]
                rec["engine_sorted_cpu"], rec["hf_sorted_cpu"] = (
                    rec["engine_cpu"],
                    rec["hf_arrival_cpu"],
                )
            target = out[workload.name]
            for key in keys[:8]:
                target[key].append(rec[key])
            target["e2e"].append(_merge_e2e(rec["e2e_groups"]))
            target["mm"].append(med(rec["mm"]))
            target["mm_cpu"].append(med(rec["mm_cpu"]))
            order = range(len(workload.sequences))
            target["diff_e2e"] = packed_vs_hf.max_abs_diff(
                [lps["engine"][i] for i in order], [lps["e2e"][i] for i in order]
            )
            target["diff_hf"] = packed_vs_hf.max_abs_diff(
                [lps["engine"][i] for i in order], [lps["hf"][i] for i in order]
            )
            tokens = workload.num_tokens
            log(
                f"  {workload.name}: engine {tokens / rec['engine']:.1f} tok/s, e2e "
                f"{tokens / target['e2e'][-1]['seconds']:.1f} tok/s, transformers arrival "
                f"{tokens / rec['hf_arrival']:.1f} tok/s"
            )
    return out


# ---- rows -----------------------------------------------------------------------------------


def per_rep(num: list[float], den: list[float]) -> tuple[float, str]:
    """Median of per-repetition ratios, and the range when there are several."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    spread = f" (reps {min(ratios):.3f}..{max(ratios):.3f})" if len(ratios) > 1 else ""
    return med(ratios), spread


def timing_rows(workloads, timings: dict, engine, on_cpu: bool) -> list[Row]:
    rows = []
    for workload in workloads:
        rec, tokens, name = timings[workload.name], workload.num_tokens, workload.name
        control = name != "rollout"
        engine_tps = [tokens / s for s in rec["engine"]]
        e2e_tps = [tokens / e["seconds"] for e in rec["e2e"]]
        value, spread = per_rep(e2e_tps, engine_tps)
        parts = [
            e2e_vs_engine.decompose(t, e) for t, e in zip(rec["engine"], rec["e2e"], strict=True)
        ]
        busy, speed = med(p[0] for p in parts), med(p[1] for p in parts)
        e2e_cpu = [e["server_cpu_s"] + e["client_cpu_s"] for e in rec["e2e"]]
        cpu_ratio = med(a / b for a, b in zip(rec["engine_cpu"], e2e_cpu, strict=True))
        by_cpu = (
            f"by CPU time (in-process engine / server + client processes) {cpu_ratio:.2f}; "
            if on_cpu
            else ""
        )
        rows.append(
            Row(
                "1",
                "e2e gRPC tokens/s / in-process engine tokens/s",
                name,
                value,
                f"e2e {med(e2e_tps):.1f} / engine {med(engine_tps):.1f} tokens/s{spread} = "
                f"server engine busy {busy:.1%} of the e2e wall x its steps' speed "
                f"{speed:.2f} of in-process; {by_cpu}max abs logprob diff "
                f"{rec['diff_e2e']:.1e}",
                None if control else E2E_TARGET,
            )
        )
        for order, number, target in (
            ("arrival", "2a", PADDED_TARGET),
            ("sorted", "2b", SORTED_TARGET),
        ):
            if control and order == "sorted":
                continue
            ours = "engine" if order == "arrival" else "engine_sorted"
            ours_tps = [tokens / s for s in rec[ours]]
            hf_tps = [tokens / s for s in rec[f"hf_{order}"]]
            value, spread = per_rep(ours_tps, hf_tps)
            pad = packed_vs_hf.padded_tokens(workload, order) / tokens
            cpu_ratio = med(rec[f"hf_{order}_cpu"]) / med(rec[f"{ours}_cpu"])
            speed = value / pad  # transformers s per computed token / megascore s per token
            scale = packed_vs_hf.padding_at_scale(order)
            caveat = ""
            if not control and (scale * speed >= target) != (value >= target):
                caveat = (
                    f"{number} ({order}): these {len(workload.sequences)} sequences pad "
                    f"x{pad:.2f}; a rollout batch of 1024 sequences of the same mix pads "
                    f"x{scale:.2f}. At the measured per-token speed ({speed:.2f}) the ratio "
                    f"there would be about {scale * speed:.2f}, which would "
                    f"{'meet' if scale * speed >= target else 'miss'} the target {target:g}."
                )
            rows.append(
                Row(
                    number,
                    f"packed megascore / padded transformers ({order} batches of 8)",
                    name,
                    value,
                    f"megascore {med(ours_tps):.1f} / transformers {med(hf_tps):.1f} tokens/s"
                    f"{spread} = padding x{pad:.2f} x per-token speed {speed:.2f}; "
                    + (f"by process CPU time {cpu_ratio:.2f}; " if on_cpu else "")
                    + (
                        ""
                        if control
                        else f"over 1024 sequences of the mix the padding is x{scale:.2f} "
                        f"(ratio about {scale * speed:.2f} at this speed); "
                    )
                    + f"max abs logprob diff {rec['diff_hf']:.1e}",
                    None if control else target,
                    caveat=caveat,
                )
            )
        flops = [mfu.achieved(engine, workload, s) for s in rec["engine"]]
        value, spread = per_rep(flops, rec["mm"])
        by_cpu = ""
        if on_cpu:
            threads = torch_threads()
            cpu_flops = [mfu.achieved(engine, workload, c / threads) for c in rec["engine_cpu"]]
            by_cpu = f"; by process CPU time {per_rep(cpu_flops, rec['mm_cpu'])[0]:.3f}"
        rows.append(
            Row(
                "3",
                "model FLOP/s / measured torch.mm FLOP/s",
                name,
                value,
                f"model {med(flops) / 1e9:.1f} / torch.mm {med(rec['mm']) / 1e9:.1f} "
                f"GFLOP/s{spread}{by_cpu}",
                MFU_TARGET if on_cpu and not control else None,
            )
        )
    return rows


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


PROFILE_TOKENS = 1024  # token budget of the one step a profile of a miss looks at


def explain_misses(rows, workloads, timings, engine, hf, device, profile: bool) -> None:
    """Fills ``why`` and ``profile`` of every missed timing row (runs the short profiles)."""
    by_name = {w.name: w for w in workloads}
    pair_profiles: dict[str, str] = {}
    for row in rows:
        if row.passed is not False or row.workload not in by_name:
            continue
        workload, rec = by_name[row.workload], timings[row.workload]
        log(f"explaining the miss of {row.number} ({row.workload})")
        if row.number == "1":
            row.why = e2e_vs_engine.explain(rec["engine"], rec["e2e"])
            row.profile = e2e_vs_engine.request_table(rec["e2e"][-1])
        elif row.number in ("2a", "2b"):
            order = "arrival" if row.number == "2a" else "sorted"
            ours = "engine" if order == "arrival" else "engine_sorted"
            row.why = packed_vs_hf.explain(
                workload, order, med(rec[ours]), med(rec[f"hf_{order}"]), row.target
            )
            if profile and workload.name not in pair_profiles:
                pair_profiles[workload.name] = packed_vs_hf.profile_pair(
                    engine, hf, workload, PROFILE_TOKENS, device
                )
            row.profile = pair_profiles.get(workload.name, "")
        elif row.number == "3":
            share, table = mfu.step_profile(engine, workload, PROFILE_TOKENS, device)
            row.why = mfu.explain(row.value, share, row.target, engine.info().vocab_size)
            row.profile = table if profile else ""


def wire_row(wire: dict, engine_tps: float, tokens: int) -> Row:
    scoring = tokens / engine_tps
    phases = ", ".join(f"{p.replace('_', ' ')} {wire[p] * 1e3:.0f}" for p in wire_cost.PHASES)
    return Row(
        "4",
        f"wire encode+decode / scoring time, {tokens / 1e6:g}M tokens, logprobs + top-5",
        "rollout",
        wire["total"] / scoring,
        f"wire {wire['total'] * 1e3:.0f} ms ({phases} ms; request {wire['request_mb']:.0f} MB, "
        f"response {wire['response_mb']:.0f} MB) / scoring {scoring:.1f} s at "
        f"{engine_tps:.1f} tokens/s",
        WIRE_TARGET,
        higher_is_better=False,
    )


def memory_row(mem: dict, device: str) -> Row:
    kind = "peak RSS" if device == "cpu" else "peak allocated"
    sizes = ", ".join(str(pt["tokens"]) for pt in mem["points"])
    return Row(
        "5",
        f"{kind} vs tokens per batch: max residual of the line / largest step growth",
        f"{len(mem['points'])} sizes ({sizes}), sequences of {mem['seq_len']}",
        mem["max_residual_frac"],
        f"fit {mem['slope'] / 1024:.1f} KiB/token + {mem['intercept'] / 2**20:.0f} MiB, "
        f"R^2 {mem['r2']:.3f}; max residual {mem['max_residual'] / 2**20:+.1f} MiB; "
        f"step growth {mem['points'][0]['growth'] / 2**20:.0f}..."
        f"{mem['points'][-1]['growth'] / 2**20:.0f} MiB",
        memory.RESIDUAL_TARGET,
        higher_is_better=False,
    )


# ---- main -----------------------------------------------------------------------------------


def measure(args: argparse.Namespace, cfg: Settings, workdir: Path) -> dict:
    """Everything but the report; returns what the report needs."""
    log(f"starting `megascore serve --model {args.model}` (subprocess)")
    server = e2e_vs_engine.start_server(
        args.device, cfg.max_tokens, workdir / "server.log", model=args.model
    )
    engine = None
    try:
        log("building the in-process engine and the transformers model")
        engine = common.create_engine(args.device, args.model)
        info = engine.info()
        machine = common.machine_info(args.device)
        hf = common.hf_llama_from_engine(engine)
        workloads = common.make_workloads(
            cfg.rollout_sequences,
            args.seed,
            info.vocab_size,
            max_len=min(2048, info.max_sequence_length),
            num_uniform=cfg.uniform_sequences,
        )
        for w in workloads:
            log(f"{w.name}: {w.summary()}")
        agreement = packed_vs_hf.check_agreement(engine, hf, workloads[0], args.device)
        log(f"logprobs megascore vs transformers: {agreement}")
        engine.score(common.score_batch(common.warmup_sequences(workloads[0])))
        server.wait_serving(1800.0)
        log(f"server SERVING on {server.target}")
        timings = timing_reps(engine, hf, server, workloads, cfg, args.device, workdir)
        rows = timing_rows(workloads, timings, engine, args.device == "cpu")
        explain_misses(rows, workloads, timings, engine, hf, args.device, not args.no_profile)
    finally:
        code = server.stop()
        log(f"server stopped (exit {code})")
        if engine is not None:
            engine.shutdown()
    del hf

    rollout = workloads[0]
    engine_tps = rollout.num_tokens / med(timings["rollout"]["engine"])
    log(f"wire cost: {cfg.wire_tokens} tokens x {cfg.wire_repeats}")
    wire = wire_cost.measure(cfg.wire_tokens, cfg.wire_repeats, info.vocab_size, args.seed)
    row = wire_row(wire, engine_tps, cfg.wire_tokens)
    if row.passed is False:
        row.why = wire_cost.explain(wire)
        if not args.no_profile:
            row.profile = wire_cost.profile(cfg.wire_tokens, info.vocab_size, args.seed)
    rows.append(row)

    log(f"memory: {cfg.memory_sizes} tokens per batch, one fresh process each")
    mem = memory.sweep(cfg.memory_sizes, args.device, jobs=cfg.memory_jobs, model=args.model)
    row = memory_row(mem, args.device)
    if row.passed is False:
        row.why = memory.explain(mem)
    rows.append(row)
    return {
        "rows": rows,
        "machine": machine,
        "info": info,
        "workloads": workloads,
        "agreement": agreement,
        "timings": timings,
        "memory": mem,
        "wire": wire,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="fewer tokens and repetitions")
    p.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-profile", action="store_true", help="skip the profiles of misses")
    p.add_argument("--model", default=common.MODEL, help="smoke tests only (e.g. tiny)")
    p.add_argument("--num-sequences", type=int, default=None, help="override the workload size")
    p.add_argument("--memory-sizes", default=None, help="override, e.g. 128,256,512,1024")
    args = p.parse_args()
    cfg = settings(args.quick)
    if args.num_sequences:
        cfg.rollout_sequences = cfg.uniform_sequences = args.num_sequences
    if args.memory_sizes:
        cfg.memory_sizes = [int(x) for x in args.memory_sizes.split(",")]
    common.quiet_logs()
    common.check_device(args.device)
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="megascore-bench-") as tmp:
        results = measure(args, cfg, Path(tmp))
    results["machine"]["load average (end)"] = common.machine_info(args.device)["load average"]
    text = report(args, cfg, results, time.time() - start)
    previous = args.output.read_text() if args.output.exists() else ""
    args.output.write_text(text)
    # sections their own scripts write: kept
    own_sections = (
        pipeline,
        weight_push,
        routing_cost,
        families_cpu,
        batch_invariance,
        option_cost,
        prefix_sharing,
        prefix_grid,
        prefix_cache,
        startup,
        data_parallel,
        replica_scaling,
        single_sequence,
        http_front,
        adapters,
        SOAK_SECTION,
    )
    for own in own_sections:
        if own.BEGIN in previous and own.END in previous:
            kept = previous[previous.index(own.BEGIN) : previous.index(own.END)]
            common.write_section(args.output, own.BEGIN, own.END, kept + own.END)
    print(text)
    log(f"wrote {args.output} in {time.time() - start:.0f} s")
    return 0


# ---- report ---------------------------------------------------------------------------------


def report(args, cfg: Settings, res: dict, elapsed: float) -> str:
    info, rows = res["info"], res["rows"]
    command = "python bench/run_all.py" + (" --quick" if args.quick else "")
    if args.model != common.MODEL or args.num_sequences or args.memory_sizes:
        command += " (with smoke-test overrides: not comparable)"
    command += f" --device {args.device}" if args.device != "cpu" else ""
    misses = [r for r in rows if r.passed is False]
    lines = [
        "# megascore benchmarks",
        "",
        f"Written by `{command}` in {elapsed / 60:.1f} min; rerun it to update this file.",
        "Definitions and how to read the numbers: [docs/benchmarks.md](../docs/benchmarks.md).",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in res["machine"].items()),
        "",
        "## Setup",
        "",
        f"* model `{info.name}`: {info.num_parameters / 1e6:.1f}M parameters, vocab "
        f"{info.vocab_size}, {info.dtype}, attention backend `{info.attention_backend}`, "
        f"device {args.device}, world size 1",
        *(f"* workload `{w.name}`: {w.summary()}; {w.description}" for w in res["workloads"]),
        f"* every request: logprobs, top-{common.TOP_K}, summed NLL on every side",
        f"* timed in rounds of {packed_vs_hf.BATCH_SIZE} sequences (one transformers batch, in "
        f"arrival order; for the rollout mix also length-sorted): megascore in-process "
        f"(token-budget batches of <= {cfg.max_tokens} tokens, the server's "
        f"`--max-tokens-per-batch`), e2e (the round as 2 concurrent requests), transformers "
        f"(one padded batch) run back to back, in an order that alternates per round; a "
        f"side's time is its sum over the rounds; `torch.mm` is timed before every megascore "
        f"run",
        f"* {cfg.reps} repetition(s); the value is the median of the per-repetition ratios; "
        f"load average at the start and end in the machine table",
        f"* logprobs megascore vs transformers before timing: max abs diff "
        f"{res['agreement']['max_abs']:.1e}, mean {res['agreement']['mean_abs']:.1e} "
        f"({res['agreement']['tolerance']})",
        "",
        "## Results",
        "",
        "| # | measurement | workload | value | target | result | measured |",
        "|---|---|---|---:|---|---|---|",
        *(
            f"| {r.number} | {r.measurement} | {r.workload} | {r.value:.3g} | "
            f"{r.target_text()} | {r.result_text()} | {r.detail} |"
            for r in rows
        ),
        "",
        f"{sum(r.passed is True for r in rows)} of {sum(r.passed is not None for r in rows)} "
        f"targets met.",
    ]
    caveats = [r.caveat for r in rows if r.caveat]
    if caveats:
        lines += ["", "## Caveats", "", *(f"* {c}" for c in caveats)]
    lines += ["", "## Memory", "", "| tokens per batch | peak MiB | growth in the step MiB |"]
    lines.append("|---:|---:|---:|")
    for pt in res["memory"]["points"]:
        lines.append(f"| {pt['tokens']} | {pt['peak'] / 2**20:.1f} | {pt['growth'] / 2**20:.1f} |")
    if misses:
        lines += ["", "## Misses", ""]
        for r in misses:
            lines += [
                f"### {r.number}. {r.measurement} ({r.workload})",
                "",
                f"{r.value:.3g} against a target of {r.target_text()}: {r.shortfall()}.",
                "",
                r.why or "(no explanation computed)",
                "",
            ]
            if r.profile:
                lines += ["```", r.profile, "```", ""]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.exit(main())

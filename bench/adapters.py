"""Weight sets and LoRA adapters on one server (issue 46's bench items), side by side in one run.

The ``bench`` architecture (95.5M parameters) as two ``transformers`` LlamaForCausalLM
checkpoints with random weights (``D0``, ``D1``, saved once to a temporary directory) and
four peft LoRA adapters over ``D0`` (r = 16, alpha 32, q/k/v/o + gate/up/down, random
``A`` and ``B``), served by ``megascore serve`` subprocesses (CPU, float32, no prefix
cache: the passes resend the same tokens) and driven through the SDK:

* ``lora``: ``--model hf:D0 --adapter a=... --adapter d=...``;
* ``sets``: ``--weights reference=hf:D0 --weights policy=hf:D1`` (resident sets);
* ``single``: ``--model hf:D0`` (one set: the memory of one server);
* ``host``: ``--weight-sets host --weights A=hf:D0 --weights B=hf:D1``.

Measurements (sizes scaled down for a 2-core CPU shared with other work):

1. **Mixed step.** Five concurrent requests (each ``--seqs`` sequences of ``--len``
   tokens) in one step (the step's budget is their tokens, so it starts when the fifth
   arrives; the server's step counter is checked): named ``a b c d`` and the base, vs the
   same five all on the base. Target: tokens/s mixed / base >= 0.8.
2. **Reference KL in one call.** One request of ``--kl-seqs`` x ``--len`` tokens on
   ``sets``: ``model="policy", reference="reference"`` vs ``model="policy"`` plus
   ``model="reference"`` (the sum). Target: one call / sum <= 1.1. Beside it: the peak
   RSS of ``sets`` vs ``single`` (after the same requests; start-up peak and serving
   peak apart: ``VmHWM`` is reset once the server serves) and vs two servers.
3. **Adapter push vs full push** into ``lora``: ``push_adapter("a", ...)`` (the peft
   state dict) vs ``push_weights`` of the full HF state dict into the default set.
   Targets: time adapter / full <= 0.05, bytes adapter / full <= 0.02 (for the four
   adapters' q/k/v/o + gate/up/down, and for an adapter with peft's default modules for
   a Llama, q_proj and v_proj, pushed once as a new adapter). The adapter side
   of a repetition is ``--adapter-pushes`` pushes in a row, counted as their mean (one
   push is a few of the 10 ms clock ticks ``/proc`` counts CPU in).
4. **Swap of a host set.** Steps of one sequence of ``--len`` tokens on ``host`` in the
   order A A B B A A ...: a step whose set is not the live one pays a swap; its cost is
   the median swap step minus the median step without a swap, divided by the set's
   GiB. The same order on ``sets`` (resident: a switch is a pointer change) is the
   control. Reported, no target.

Server CPU seconds (``ServeProcess.cpu_seconds``: the server process and its
descendants) are the primary measure; wall seconds beside them. Each server runs
``--threads`` intra-op threads (default 1): on 2 cores shared with other jobs, a
server's second OpenMP thread waits for a core at every parallel region, and those waits
count as CPU seconds (many small ops, like the LoRA rows', pay most). Ratios are medians
over ``--reps`` repetitions whose sides alternate in order. On a miss of item 1 or 3a an
engine in this process shows why (a profile of a mixed step; the engine's own part of an
adapter push, without gRPC).

Usage: ``python bench/adapters.py [--reps 3]`` writes (or replaces) the section between
the ``adapters.py`` markers of bench/RESULTS.md (``run_all.py`` keeps it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import logging
import re
import statistics
import tempfile
import time
from pathlib import Path

import common
import numpy as np

from megascore_server import procfs

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- adapters.py: begin -->", "<!-- adapters.py: end -->"
VOCAB = 32000
ADAPTERS = ("a", "b", "c", "d")
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 16, 32
MIXED_TARGET, KL_TARGET, PUSH_TIME_TARGET, PUSH_BYTES_TARGET = 0.8, 1.1, 0.05, 0.02


# ---- checkpoints ----------------------------------------------------------------------------


def _hf_model(seed: int):
    """The ``bench`` shape as a LlamaForCausalLM, random weights spread over a few nats
    (HF's 0.02 init is near uniform), as ``bench/weight_push.py`` makes it."""
    import torch
    import transformers

    from megascore.model.config import builtin_model

    torch.manual_seed(seed)
    config = common.hf_llama_config(builtin_model(common.MODEL), torch.float32)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_((1.0 if "embed" in name else 2.0) / (0.02 * p.shape[-1] ** 0.5))
    return model


def write_checkpoints(workdir: Path) -> dict:
    """``D0``, ``D1`` and the adapters; returns the push payloads and their sizes."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    out = {}
    for seed, name in ((0, "D0"), (1, "D1")):
        model = _hf_model(seed)
        model.save_pretrained(workdir / name)
        if name == "D0":
            out["full"] = {k: v.clone() for k, v in model.state_dict().items()}
            base = model
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGET_MODULES)
    peft = get_peft_model(base, config)
    for i, name in enumerate(ADAPTERS):
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for pname, p in peft.named_parameters():
                if "lora_" in pname:  # [r, in] and [out, r]: entries ~ 0.5 N / sqrt(fan in)
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / p.shape[-1] ** 0.5)
        peft.save_pretrained(workdir / name)
    out["adapter"] = {k: v.clone() for k, v in get_peft_model_state_dict(peft).items()}
    out["adapter_config"] = peft.peft_config["default"]
    # peft's own choice of modules for a Llama (no target_modules given: q_proj, v_proj)
    defaults = get_peft_model(_hf_model(0), LoraConfig(r=RANK, lora_alpha=ALPHA))
    out["default_adapter"] = dict(get_peft_model_state_dict(defaults))
    out["default_adapter_config"] = defaults.peft_config["default"]
    out["full_params"] = sum(t.numel() for t in out["full"].values())
    out["adapter_params"] = sum(t.numel() for t in out["adapter"].values())
    out["target_params"] = sum(  # the base weights the adapter's modules change
        t.numel() for k, t in out["full"].items() if any(f".{m}." in k for m in TARGET_MODULES)
    )
    return out


# ---- servers --------------------------------------------------------------------------------


def start(name: str, workdir: Path, budget: int, threads: int, *flags: str):
    from megascore_server.serve_process import ServeProcess

    base = ["--device", "cpu", "--dtype", "float32", "--no-prefix-cache"]
    base += ["--max-tokens-per-batch", str(budget), "--max-batch-wait-ms", "1000"]
    env = {"OMP_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": ""}
    server = ServeProcess(workdir / f"{name}.log", *base, *flags, metrics=True, env=env)
    logger.info("started %s: %s", name, " ".join(server.cmd))
    return server


def steps_run(server) -> float:
    return float(re.search(r"^megascore_steps_total (\S+)$", server.metrics_text(), re.M)[1])


def peak_kib(server) -> int:
    return sum(procfs.status_kib(pid, "VmHWM") for pid in server.tree())


def reset_peak(server) -> None:
    for pid in server.tree():
        procfs.reset_peak_rss(pid)


def timed(server, fn):
    """``(wall s, server CPU s, fn())``."""
    cpu, start = server.cpu_seconds(), time.perf_counter()
    out = fn()
    return time.perf_counter() - start, server.cpu_seconds() - cpu, out


def sequences(rng, num: int, length: int) -> list[list[int]]:
    return [rng.integers(0, VOCAB, length).tolist() for _ in range(num)]


# ---- measurements ---------------------------------------------------------------------------


def mixed_step(args, server, client, rng) -> dict:
    """Item 1: five concurrent requests in one step, four adapters + base vs all base."""
    requests = [sequences(rng, args.seqs, args.len) for _ in range(len(ADAPTERS) + 1)]
    sides = {"mixed": [*ADAPTERS, ""], "base": [""] * (len(ADAPTERS) + 1)}
    pool = concurrent.futures.ThreadPoolExecutor(len(requests))

    def step(names):
        futures = [
            pool.submit(client.score, r, model=n) for r, n in zip(requests, names, strict=True)
        ]
        return [f.result() for f in futures]

    for names in sides.values():  # warm-up: the first step of each kind
        step(names)
    out = {side: [] for side in sides}
    answers = {}
    for rep in range(args.reps):
        for side in sides if rep % 2 == 0 else reversed(list(sides)):
            before = steps_run(server)
            wall, cpu, answers[side] = timed(server, lambda s=side: step(sides[s]))
            out[side].append((wall, cpu, steps_run(server) - before))
            logger.info("mixed step rep %d %s: %.2f s wall, %.2f s CPU", rep, side, wall, cpu)
    pool.shutdown()
    # the base request of the mixed step = the same request in the all-base step
    out["base_equal"] = bool(
        np.array_equal(answers["mixed"][-1].logprobs[0], answers["base"][-1].logprobs[0])
    )
    out["adapters_differ"] = not np.array_equal(
        answers["mixed"][0].logprobs[0], answers["base"][0].logprobs[0]
    )
    out["tokens"] = (len(ADAPTERS) + 1) * args.seqs * args.len
    return out


def reference_kl(args, server, client, rng) -> dict:
    """Item 2: policy + reference + KL in one call vs the two sets alone (the sum)."""
    seqs = sequences(rng, args.kl_seqs, args.len)
    calls = {
        "kl": lambda: client.score(seqs, model="policy", reference="reference"),
        "policy": lambda: client.score(seqs, model="policy"),
        "reference": lambda: client.score(seqs, model="reference"),
    }
    for fn in calls.values():
        fn()  # warm-up
    out = {name: [] for name in calls}
    answers = {}
    order = list(calls)
    for rep in range(args.reps):
        for name in order[rep % 3 :] + order[: rep % 3]:
            wall, cpu, answers[name] = timed(server, calls[name])
            out[name].append((wall, cpu))
            logger.info("reference KL rep %d %s: %.2f s wall, %.2f s CPU", rep, name, wall, cpu)
    kl, policy, ref = answers["kl"], answers["policy"], answers["reference"]
    worst = 0.0
    for i in range(len(seqs)):
        assert np.array_equal(kl.reference_logprobs[i], ref.logprobs[i])
        assert np.array_equal(kl.logprobs[i], policy.logprobs[i])
        r = ref.logprobs[i].astype(np.float64) - policy.logprobs[i].astype(np.float64)
        worst = max(worst, abs(float(kl.kl_mean["k1"][i]) - float(np.mean(-r[1:]))))
    out["kl_check"] = worst
    out["kl_k3"] = float(np.mean([kl.kl_mean["k3"][i] for i in range(len(seqs))]))
    out["seqs"] = seqs
    return out


def single_memory(server, client, seqs) -> None:
    """The one-set server scores the same request twice (its serving peak)."""
    for _ in range(2):
        client.score(seqs)


def pushes(args, server, client, payload: dict) -> dict:
    """Item 3: adapter push vs full push into the same server, alternating."""
    out = {"adapter": [], "full": []}
    cpu = server.cpu_seconds()
    time.sleep(2.0)
    out["idle_cpu_per_s"] = (server.cpu_seconds() - cpu) / 2.0  # the server's own threads
    for rep in range(args.reps):
        sides = ("adapter", "full") if rep % 2 == 0 else ("full", "adapter")
        for side in sides:
            count = args.adapter_pushes if side == "adapter" else 1
            if side == "adapter":  # several in a row: one is a few 10 ms clock ticks of CPU
                fn = lambda r=rep, n=count: [  # noqa: E731
                    client.push_adapter(
                        "a", payload["adapter"], payload["adapter_config"],
                        weights_version=f"a-{r}-{i}",
                    )
                    for i in range(n)
                ][-1]  # fmt: skip
            else:
                fn = lambda r=rep: client.push_weights(  # noqa: E731
                    payload["full"].items(), weights_version=f"full-{r}"
                )
            wall, cpu, pushed = timed(server, fn)
            wall, cpu = wall / count, cpu / count
            out[side].append((wall, cpu, pushed))
            logger.info(
                "push rep %d %s: %.3f s wall, %.3f s CPU, %d bytes, server stream %.0f ms, "
                "swap %.0f ms", rep, side, wall, cpu, pushed.num_bytes,
                pushed.server_stream_ms, pushed.server_swap_ms,
            )  # fmt: skip
    out["default_bytes"] = client.push_adapter(
        "peft-defaults", payload["default_adapter"], payload["default_adapter_config"],
        weights_version="d-0",
    ).num_bytes  # fmt: skip
    return out


def swaps(args, server, client, rng, names: tuple[str, str]) -> dict:
    """Item 4: steps in the order A A B B ...; a step whose set is not live pays a swap."""
    seq = sequences(rng, 1, args.len)
    a, b = names
    client.score(seq, model=b)
    client.score(seq, model=a)  # warm-up; A live
    live, steps = a, []
    for i in range(4 * args.swap_cycles):
        name = a if (i // 2) % 2 == 0 else b
        wall, cpu, _ = timed(server, lambda n=name: client.score(seq, model=n))
        steps.append((name != live, wall, cpu))
        live = name
    return {"steps": steps}


def in_process(args, workdir: Path, payload: dict, mixed: bool, push: bool) -> dict:
    """On a miss, what one engine in this process (the ``lora`` server's model and adapters,
    ``--threads`` intra-op threads) shows: item 1, ``torch.profiler`` of one mixed step;
    item 3a, the engine's own part of an adapter push (begin, stage, commit: the adapter
    checked and its fused layers built), without gRPC, median of 3."""
    import dataclasses

    import torch

    from megascore.api.types import ScoreBatch
    from megascore.config import EngineConfig
    from megascore.engine.runtime import DistributedEngine

    torch.set_num_threads(args.threads)
    common.single_rank_env()
    cfg = EngineConfig(
        model=f"hf:{workdir / 'D0'}", device="cpu", dtype="float32", prefix_cache=False,
        adapters=tuple(f"{n}={workdir / n}" for n in ADAPTERS),
    )  # fmt: skip
    engine = DistributedEngine.create(cfg)
    out = {}
    try:
        if mixed:
            num = (len(ADAPTERS) + 1) * args.seqs
            ids = np.random.default_rng(args.seed).integers(0, VOCAB, num * args.len)
            slots = [engine.sets.adapters[n].slot for n in ADAPTERS] + [-1]
            batch = ScoreBatch(
                token_ids=ids,
                lengths=np.full(num, args.len, dtype=np.int64),
                adapter=np.repeat(np.array(slots, np.int64), args.seqs),
            )
            engine.score(batch)  # warm-up
            out["mixed_profile"] = common.torch_profile(
                lambda: engine.score(dataclasses.replace(batch)), "cpu", 8
            )
        if push:
            config = payload["adapter_config"].to_dict()
            config = json.dumps(
                config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)
            )
            times = []
            for rep in range(4):
                cpu, start = time.process_time(), time.perf_counter()
                engine.begin_adapter_push("a", config)
                for name, t in payload["adapter"].items():
                    raw = t.contiguous().view(-1).view(torch.uint8).numpy()
                    engine.stage_weight(name, "float32", tuple(t.shape), raw, 0)
                engine.commit_weights(f"in-process-{rep}", False)
                times.append((time.perf_counter() - start, time.process_time() - cpu))
            out["engine_push"] = (_med([w for w, _ in times[1:]]), _med([c for _, c in times[1:]]))
    finally:
        engine.shutdown()
    return out


def measure(args, workdir: Path) -> dict:
    from megascore_client import ScoringClient

    t0 = time.time()
    payload = write_checkpoints(workdir)
    logger.info("checkpoints written in %.0f s", time.time() - t0)
    d0, d1 = f"hf:{workdir / 'D0'}", f"hf:{workdir / 'D1'}"
    mixed_budget = (len(ADAPTERS) + 1) * args.seqs * args.len
    kl_budget = max(args.kl_seqs * args.len, mixed_budget)
    adapter_flags = [f for n in ADAPTERS for f in ("--adapter", f"{n}={workdir / n}")]
    servers = {
        "lora": start("lora", workdir, mixed_budget, args.threads, "--model", d0, *adapter_flags),
        "sets": start(
            "sets",
            workdir,
            kl_budget,
            args.threads,
            "--weights",
            f"reference={d0}",
            "--weights",
            f"policy={d1}",
        ),
        "single": start("single", workdir, kl_budget, args.threads, "--model", d0),
        "host": start(
            "host",
            workdir,
            kl_budget,
            args.threads,
            "--weight-sets",
            "host",
            "--weights",
            f"A={d0}",
            "--weights",
            f"B={d1}",
        ),  # fmt: skip
    }
    res: dict = {"payload_sizes": {k: v for k, v in payload.items() if k.endswith("params")}}
    clients = {}
    try:
        for name, server in servers.items():
            server.wait_serving(600)
            clients[name] = ScoringClient(server.target, timeout=1200)
        res["startup_peak_mib"] = {k: peak_kib(s) / 1024 for k, s in servers.items()}
        for server in servers.values():
            reset_peak(server)
        rng = np.random.default_rng(args.seed)
        res["mixed"] = mixed_step(args, servers["lora"], clients["lora"], rng)
        res["kl"] = reference_kl(args, servers["sets"], clients["sets"], rng)
        single_memory(servers["single"], clients["single"], res["kl"].pop("seqs"))
        res["serving_peak_mib"] = {k: peak_kib(servers[k]) / 1024 for k in ("sets", "single")}
        res["rss_mib"] = {k: servers[k].total_rss_kb() / 1024 for k in ("sets", "single")}
        servers.pop("single").stop()
        res["push"] = pushes(args, servers["lora"], clients["lora"], payload)
        servers.pop("lora").stop()
        res["swap"] = {
            "host": swaps(args, servers["host"], clients["host"], rng, ("A", "B")),
            "resident": swaps(args, servers["sets"], clients["sets"], rng, ("reference", "policy")),
        }
    finally:
        for client in clients.values():
            client.close()
        for server in servers.values():
            server.stop()
    m, p = res["mixed"], res["push"]
    mixed_miss = (
        _med([b[1] / x[1] for x, b in zip(m["mixed"], m["base"], strict=True)]) < MIXED_TARGET
    )
    push_miss = (
        _med([a[1] / f[1] for a, f in zip(p["adapter"], p["full"], strict=True)]) > PUSH_TIME_TARGET
    )
    if args.profile and (mixed_miss or push_miss):
        res.update(in_process(args, workdir, payload, mixed_miss, push_miss))
    return res


# ---- report ---------------------------------------------------------------------------------


def _med(values) -> float:
    return float(statistics.median(values))


def _verdict(ok: bool) -> str:
    return "pass" if ok else "MISS"


def push_why(res, p) -> str:
    """Why the adapter push costs more than its bytes: the engine's part vs the server's."""
    server = _med([c for _, c, _ in p["adapter"]])
    full = _med([c for _, c, _ in p["full"]])
    text = (
        f"not its bytes: the full push costs {full / (p['full'][0][2].num_bytes / 1e6) * 1e3:.1f} "
        f"ms of server CPU per MB, which would make the adapter's "
        f"{p['adapter'][0][2].num_bytes / 1e6:.1f} MB "
        f"{full / p['full'][0][2].num_bytes * p['adapter'][0][2].num_bytes * 1e3:.0f} ms; the "
        f"adapter push is {p['adapter'][0][2].num_tensors} small tensors (several to a "
        f"message, UpdateWeightsRequest.chunks, and one staging call per message)"
    )
    if "engine_push" in res:
        wall, cpu = res["engine_push"]
        text += (
            f"; in process (no gRPC) the engine's part of the same push (begin, stage, commit: "
            f"checked, fused layers built) takes {cpu * 1e3:.0f} ms CPU ({wall * 1e3:.0f} ms "
            f"wall), so {max(server - cpu, 0) * 1e3:.0f} of the server's {server * 1e3:.0f} ms "
            f"are the push's gRPC path (messages, parse, hop to the engine thread, the swap "
            f"barrier); at {cpu * 1e3:.0f} ms the ratio would be {cpu / full:.3f}"
        )
    return text


def rows(res, args) -> tuple[list[tuple], dict]:
    """``(measurement, value, target, ok, measured, why-if-missed)`` rows and derived numbers."""
    table, d = [], {}
    m = res["mixed"]
    ratios = [b[1] / x[1] for x, b in zip(m["mixed"], m["base"], strict=True)]
    walls = [b[0] / x[0] for x, b in zip(m["mixed"], m["base"], strict=True)]
    steps = sorted({s for side in ("mixed", "base") for _, _, s in m[side]})
    tokens = m["tokens"]
    base_rate = tokens / _med([c for _, c, _ in m["base"]])
    mixed_rate = tokens / _med([c for _, c, _ in m["mixed"]])
    value = _med(ratios)
    table.append((
        "1. a step of 4 adapters + base, tokens/s / base alone (server CPU s)",
        value, f">= {MIXED_TARGET}", value >= MIXED_TARGET,
        f"{tokens} tokens per step (5 requests of {args.seqs} x {args.len}); mixed "
        f"{mixed_rate:.0f} / base {base_rate:.0f} tokens per server CPU s; wall ratio "
        f"{_med(walls):.2f}; reps {min(ratios):.2f}..{max(ratios):.2f}; steps per side "
        f"{'/'.join(f'{s:g}' for s in steps)}; the base request in the mixed step = alone: "
        f"{'bitwise' if m['base_equal'] else 'NOT bitwise'}",
        "the LoRA rows' extra work: per adapter and module, a gather of its rows, "
        "`(x @ A.T) @ B.T` and an `index_add_`",
    ))  # fmt: skip
    k = res["kl"]
    sums = [p[1] + r[1] for p, r in zip(k["policy"], k["reference"], strict=True)]
    ratios = [kl[1] / s for kl, s in zip(k["kl"], sums, strict=True)]
    walls = [
        kl[0] / (p[0] + r[0]) for kl, p, r in zip(k["kl"], k["policy"], k["reference"], strict=True)
    ]
    value = _med(ratios)
    set_mib = res["payload_sizes"]["full_params"] * 4 / 2**20
    sp, rss = res["serving_peak_mib"], res["rss_mib"]
    up = res["startup_peak_mib"]
    d["memory"] = (sp, rss, up, set_mib)
    table.append((
        "2. policy + reference + KL in one call / policy alone + reference alone (server CPU s)",
        value, f"<= {KL_TARGET}", value <= KL_TARGET,
        f"{args.kl_seqs} x {args.len} tokens; one call {_med([c for _, c in k['kl']]):.2f} s, "
        f"policy {_med([c for _, c in k['policy']]):.2f} s + reference "
        f"{_med([c for _, c in k['reference']]):.2f} s; wall ratio {_med(walls):.2f}; reps "
        f"{min(ratios):.2f}..{max(ratios):.2f}; the call's logprobs = each set alone bitwise, "
        f"KL k1 mean vs numpy {k['kl_check']:.1e}; peak RSS serving: two sets "
        f"{sp['sets']:.0f} MiB vs one set {sp['single']:.0f} MiB + the second set's "
        f"{set_mib:.0f} MiB = {sp['single'] + set_mib:.0f} MiB, two servers "
        f"{2 * sp['single']:.0f} MiB",
        "the reference forward's cost beyond a plain logprob step (the KL estimators, the "
        "extra outputs)",
    ))  # fmt: skip
    p = res["push"]
    full_b, ad_b = p["full"][0][2].num_bytes, p["adapter"][0][2].num_bytes
    ratios = [a[1] / f[1] for a, f in zip(p["adapter"], p["full"], strict=True)]
    walls = [a[0] / f[0] for a, f in zip(p["adapter"], p["full"], strict=True)]
    value = _med(ratios)
    wall = _med(walls)
    d["push_wall"] = wall
    table.append((
        "3a. adapter push / full push time (server CPU s)",
        value, f"<= {PUSH_TIME_TARGET}", value <= PUSH_TIME_TARGET,
        f"adapter (mean of {args.adapter_pushes} in a row) "
        f"{_med([c for _, c, _ in p['adapter']]):.3f} s CPU, "
        f"{_med([w for w, _, _ in p['adapter']]):.3f} s wall; full "
        f"{_med([c for _, c, _ in p['full']]):.3f} s CPU, "
        f"{_med([w for w, _, _ in p['full']]):.3f} s wall; wall ratio {wall:.3f} "
        f"({'pass' if wall <= PUSH_TIME_TARGET else 'MISS'} by wall); reps "
        f"{min(ratios):.3f}..{max(ratios):.3f}; server's own split, stream / swap: adapter "
        f"{_med([x.server_stream_ms for _, _, x in p['adapter']]):.0f} / "
        f"{_med([x.server_swap_ms for _, _, x in p['adapter']]):.0f} ms, full "
        f"{_med([x.server_stream_ms for _, _, x in p['full']]):.0f} / "
        f"{_med([x.server_swap_ms for _, _, x in p['full']]):.0f} ms; the idle server "
        f"burns {p['idle_cpu_per_s']:.3f} CPU s per s",
        push_why(res, p),
    ))  # fmt: skip
    sizes = res["payload_sizes"]
    value = ad_b / full_b
    table.append((
        "3b. adapter push bytes / full push bytes (r = 16)",
        value, f"<= {PUSH_BYTES_TARGET}", value <= PUSH_BYTES_TARGET,
        f"{ad_b / 1e6:.2f} MB / {full_b / 1e6:.1f} MB (`num_bytes` of the answers; "
        f"{sizes['adapter_params'] / 1e6:.2f}M adapter parameters, "
        f"{sizes['full_params'] / 1e6:.1f}M in the model)",
        f"the shape: a module's adapter has r (in + out) parameters, r (1/in + 1/out) of its "
        f"weight's; over q/k/v/o + gate/up/down that is "
        f"{sizes['adapter_params'] / sizes['target_params']:.2%} of the "
        f"{sizes['target_params'] / 1e6:.1f}M targeted parameters, and the embeddings and "
        f"head ({(sizes['full_params'] - sizes['target_params']) / 1e6:.1f}M) are not "
        f"enough to bring it under 2 %; the push sends the adapter's tensors only (bytes = "
        f"its fp32 tensors)",
    ))  # fmt: skip
    value = p["default_bytes"] / full_b
    table.append((
        "3b'. the same with peft's default modules for a Llama (`LoraConfig(r=16)`: "
        "q_proj, v_proj)",
        value, f"<= {PUSH_BYTES_TARGET}", value <= PUSH_BYTES_TARGET,
        f"{p['default_bytes'] / 1e6:.2f} MB / {full_b / 1e6:.1f} MB (`num_bytes` of its "
        f"push's answer, pushed once as a new adapter)",
        "the shape, as in 3b",
    ))  # fmt: skip
    gib = full_b / 2**30
    for kind in ("host", "resident"):
        steps = res["swap"][kind]["steps"]
        for index, unit in ((2, "CPU"), (1, "wall")):
            swap = _med([s[index] for s in steps if s[0]])
            plain = _med([s[index] for s in steps if not s[0]])
            d[(kind, unit)] = (swap, plain, (swap - plain) / gib)
    d["gib"] = gib
    return table, d


def section(res, args, elapsed: float, load_start: str, load_end: str) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    table, d = rows(res, args)
    sp, rss, up, set_mib = d["memory"]
    lines = [
        BEGIN,
        "## Weight sets and LoRA adapters (`bench/adapters.py`)",
        "",
        f"Written by `python bench/adapters.py --reps {args.reps}` in {elapsed / 60:.1f} min "
        f"({now}, load average {load_start} at the start, {load_end} at the end); rerun it "
        "to update this section.",
        "",
        "* model `bench` (95.5M parameters) as two random `hf:` Llama checkpoints D0, D1 "
        "(CPU, float32), `megascore serve` subprocesses with `--no-prefix-cache`, SDK over "
        "gRPC: `lora` (D0 + 4 peft adapters, r = 16, alpha 32, q/k/v/o + gate/up/down), "
        "`sets` (`--weights reference=D0 --weights policy=D1`, resident), `single` (D0), "
        "`host` (`--weight-sets host`, A = D0, B = D1)",
        f"* scaled for a 2-core CPU shared with other work: {args.threads} intra-op "
        f"thread(s) per server (`OMP_NUM_THREADS`), sequences of {args.len} tokens, "
        f"the mixed step 5 x {args.seqs} of them, the KL call {args.kl_seqs}; {args.reps} "
        "repetitions, the sides alternating; value: median over them of the ratio of server "
        "CPU seconds (wall beside it)",
        "",
        "| measurement | value | target | result | measured |",
        "|---|---:|---|---|---|",
    ]
    misses = []
    for name, value, target, ok, detail, why in table:
        lines.append(f"| {name} | {value:.3f} | {target} | {_verdict(ok)} | {detail} |")
        if not ok:
            misses.append((name, why))
    swap_lines = []
    for kind in ("host", "resident"):
        cpu, wall = d[(kind, "CPU")], d[(kind, "wall")]
        swap_lines.append(
            f"| {kind} | {cpu[1]:.3f} / {cpu[0]:.3f} | {cpu[2]:.2f} | {wall[1]:.3f} / "
            f"{wall[0]:.3f} | {wall[2]:.2f} |"
        )
    met = sum(row[3] for row in table)
    lines += [
        "",
        f"Swap of a set (item 4, no target): steps of 1 x {args.len} tokens in the order "
        f"A A B B ..., {args.swap_cycles} cycles; a step whose set is not the live one pays "
        f"the switch; cost per GiB = (median switch step - median step without) / the set's "
        f"{d['gib']:.3f} GiB. `resident` (the `sets` server) is the control.",
        "",
        "| sets | CPU s: step / step after a switch | CPU s per GiB | wall s: step / after a "
        "switch | wall s per GiB |",
        "|---|---:|---:|---:|---:|",
        *swap_lines,
        "",
        f"Memory (MiB; `VmHWM` of the server's processes): start-up peak sets "
        f"{up['sets']:.0f}, single {up['single']:.0f}, lora {up['lora']:.0f}, host "
        f"{up['host']:.0f}; serving peak (reset once SERVING, then the same requests) sets "
        f"{sp['sets']:.0f} vs single {sp['single']:.0f} (+ {sp['sets'] - sp['single']:.0f}; "
        f"one set is {set_mib:.0f}); RSS after them sets {rss['sets']:.0f}, single "
        f"{rss['single']:.0f}.",
        "",
        f"{met} of {len(table)} targets met.",
    ]
    for name, why in misses:
        lines.append(f"* miss, {name.split('.')[0]}: {why}.")
    if res.get("mixed_profile"):
        lines += [
            "",
            f"Profile of one mixed step in process ({args.threads} thread(s), top ops by "
            "self CPU time):",
            "",
            "```",
            res["mixed_profile"].rstrip(),
            "```",
        ]
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--seqs", type=int, default=2, help="sequences per request of the mixed step")
    p.add_argument("--kl-seqs", type=int, default=4, help="sequences of the KL request")
    p.add_argument("--swap-cycles", type=int, default=4, help="A A B B cycles of item 4")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--threads", type=int, default=1,
        help="intra-op threads of each server (OMP_NUM_THREADS; 1: CPU seconds count work, "
        "not OpenMP waits on a machine shared with other jobs)",
    )  # fmt: skip
    p.add_argument(
        "--profile", action=argparse.BooleanOptionalAction, default=True,
        help="on a miss of item 1, profile one mixed step in process",
    )  # fmt: skip
    p.add_argument(
        "--adapter-pushes", type=int, default=5,
        help="item 3: adapter pushes in a row per repetition (their mean is one push: server "
        "CPU is read in 10 ms clock ticks, and one adapter push is a few of them)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    common.quiet_logs()
    logger.setLevel(logging.INFO)
    start, load_start = time.time(), common.load_average()
    with tempfile.TemporaryDirectory(prefix="megascore-adapters-") as tmp:
        res = measure(args, Path(tmp))
    logger.info("raw: %s", {k: v for k, v in res.items() if k != "push"})
    text = section(res, args, time.time() - start, load_start, common.load_average())
    common.write_section(args.output, BEGIN, END, text)
    print(text)


if __name__ == "__main__":
    main()

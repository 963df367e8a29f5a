"""Shared prefixes (GRPO groups, agentic histories) and scored-rows-only heads, end to end.

Two ``megascore serve --model bench`` subprocesses (CPU, float32), one with
``--no-prefix-sharing`` (dense) and one with prefix sharing on (the default,
``--min-shared-prefix 16``), both ``--max-tokens-per-batch`` large enough for a
whole group per step, both ``--no-prefix-cache`` (sharing within a call, through the
cache's mechanism: docs/engine.md "Prefix cache"; nothing kept between calls). The SDK
sends each group (one prompt + its n continuations) as one request, 2 requests in
flight; the two servers take turns, the order alternating per repetition. Workloads
(scaled down for a 2-core CPU, see docs/benchmarks.md):

1. **grpo**: ``--prompts`` prompts x n = 8 responses; prompt lengths log-normal
   (median 512, sigma 0.8, clipped to [64, 2048]), response lengths log-normal
   (median 512, sigma 0.8, clipped to [16, 2048]); logprobs + top-5 + NLL.
   Target: shared >= 1.8x dense.
2. **agentic**: ``--histories`` histories of ``--history-len`` tokens x 8 next turns
   (log-normal median ``--turn-len``, sigma 0.3, clipped to [64, 1024]); logprobs +
   top-5 + NLL. Target >= 4x. The defaults (2 x 2048 x 8 turns of ~128) keep the
   issue's 16 : 1 history : turn ratio (8 x 8k x 8 turns of ~512) at a quarter of the
   length (the bench model's positions end at 4096).
3. **response-only**: a prompt-heavy mix (no shared prompts: ``--heavy`` prompts log-normal
   median 768 clipped to [256, 2048], each with one response of median 128 clipped to
   [16, 512]), the loss mask on the response; ``return_logprobs=False`` + NLL (the
   head runs only on the response rows) vs the same request with logprobs (every
   row), on the dense server. Target >= 1.15x.

A ratio is the dense-equivalent tokens/s (every sequence's full length counted) of
one side over the other, by the server process's CPU seconds (on a shared machine
they barely move with the load; wall-clock ratios are reported beside them); the
median over repetitions. Peak memory is each server's peak RSS (``VmHWM``); the
shared results are checked against the dense ones (max abs logprob difference).

Usage: ``python bench/prefix_sharing.py [--reps R] [--output bench/RESULTS.md]`` writes
(or replaces) the section between the ``prefix_sharing.py`` markers of RESULTS.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import logging
import statistics
import tempfile
import time
from pathlib import Path

import common
import numpy as np
from e2e_vs_engine import start_server

from megascore_server import procfs

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
VOCAB = 32000
N = 8
IN_FLIGHT = 2
MAX_TOKENS = 40960
TARGETS = {"grpo": 1.8, "agentic": 4.0, "response-only": 1.15}
BEGIN, END = "<!-- prefix_sharing.py: begin -->", "<!-- prefix_sharing.py: end -->"


@dataclasses.dataclass
class Group:
    """One request: sequences (prompt + continuation) and the loss mask of each."""

    sequences: list[np.ndarray]
    masks: list[np.ndarray]


def _lognormal(rng, num: int, median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, num)), lo, hi).astype(int)


def _groups(rng, prompt_lens, cont_lens_per_prompt) -> list[Group]:
    groups = []
    for p_len, c_lens in zip(prompt_lens, cont_lens_per_prompt, strict=True):
        prompt = rng.integers(0, VOCAB, int(p_len))
        seqs = [np.concatenate([prompt, rng.integers(0, VOCAB, int(c))]) for c in c_lens]
        masks = [np.r_[np.zeros(int(p_len), np.uint8), np.ones(int(c), np.uint8)] for c in c_lens]
        groups.append(Group(seqs, masks))
    return groups


def grpo_groups(prompts: int, seed: int) -> list[Group]:
    rng = np.random.default_rng(seed)
    p_lens = _lognormal(rng, prompts, 512, 0.8, 64, 2048)
    return _groups(rng, p_lens, [_lognormal(rng, N, 512, 0.8, 16, 2048) for _ in p_lens])


def agentic_groups(histories: int, history_len: int, turn_len: int, seed: int) -> list[Group]:
    rng = np.random.default_rng(seed)
    turns = [_lognormal(rng, N, turn_len, 0.3, 64, 1024) for _ in range(histories)]
    return _groups(rng, [history_len] * histories, turns)


def prompt_heavy_groups(count: int, seed: int) -> list[Group]:
    rng = np.random.default_rng(seed)
    p_lens = _lognormal(rng, count, 768, 0.5, 256, 2048)
    responses = _lognormal(rng, count, 128, 0.5, 16, 512)
    singles = _groups(rng, p_lens, [[r] for r in responses])
    # requests of 8 sequences, like the groups
    return [
        Group(
            [s for g in singles[i : i + N] for s in g.sequences],
            [m for g in singles[i : i + N] for m in g.masks],
        )
        for i in range(0, len(singles), N)
    ]


def tokens(groups: list[Group]) -> int:
    return sum(len(s) for g in groups for s in g.sequences)


def _layouts(groups: list[Group]):
    """Each group's sequence lengths and the prefix tree the shared server cuts it into."""
    from megascore.engine.layout.prefix_tree import shared_layout

    for g in groups:
        lengths = np.array([len(s) for s in g.sequences])
        yield lengths, shared_layout(np.concatenate(g.sequences), lengths, min_shared=16)


def computed_tokens(groups: list[Group]) -> int:
    """Tokens the shared server computes (the segments of every group)."""
    return sum(int(layout.lengths.sum()) for _, layout in _layouts(groups))


def attention_ratio(groups: list[Group]) -> float:
    """Dense over shared attention work (query-key pairs): what sharing saves of the
    attention, less than of the rows, since a continuation still attends to its prefix
    (a segment of ``n`` rows after ``p`` prefix rows: ``n * p + n (n + 1) / 2`` pairs)."""
    dense = shared = 0
    for lengths, layout in _layouts(groups):
        dense += int((lengths * (lengths + 1) // 2).sum())
        n, p = layout.lengths, layout.offsets
        shared += int((n * p + n * (n + 1) // 2).sum())
    return dense / shared


def score_pass(client, groups: list[Group], pid: int, **options):
    """Scores every group as one request; returns (wall s, server CPU s, results)."""
    cpu = procfs.cpu_seconds(pid)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        results = list(
            pool.map(
                lambda g: client.score(g.sequences, loss_mask=g.masks, **options),
                groups,
            )
        )
    return time.perf_counter() - start, procfs.cpu_seconds(pid) - cpu, results


FULL = dict(top_k=common.TOP_K, losses=common.LOSSES)


def measure(args, workdir: Path) -> dict:
    from megascore_client import ScoringClient

    workloads = {
        "grpo": grpo_groups(args.prompts, args.seed),
        "agentic": agentic_groups(args.histories, args.history_len, args.turn_len, args.seed),
    }
    heavy = prompt_heavy_groups(args.heavy, args.seed)
    servers = {
        "dense": start_server(
            "cpu", MAX_TOKENS, workdir / "dense.log", extra_args=("--no-prefix-sharing",)
        ),
        "shared": start_server("cpu", MAX_TOKENS, workdir / "shared.log"),
    }
    runs = {name: {"dense": [], "shared": []} for name in workloads}
    runs["response-only"] = {"all rows": [], "scored rows": []}
    last = {}
    try:
        for server in servers.values():
            server.wait_serving(600)
        clients = {k: ScoringClient(s.target, timeout=3600) for k, s in servers.items()}
        pids = {k: s.proc.pid for k, s in servers.items()}
        warm = [
            Group([s[:256] for s in g.sequences[:4]], [m[:256] for m in g.masks[:4]])
            for g in workloads["grpo"][:1]
        ]
        for side in servers:
            score_pass(clients[side], warm, pids[side], **FULL)
        for rep in range(args.reps):
            for name, groups in workloads.items():
                order = ("dense", "shared") if rep % 2 == 0 else ("shared", "dense")
                for side in order:
                    wall, cpu, results = score_pass(clients[side], groups, pids[side], **FULL)
                    runs[name][side].append((wall, cpu))
                    last[(name, side)] = results
                    logger.info("%s %s: %.1f s wall, %.1f s CPU", name, side, wall, cpu)
            sides = (("all rows", True), ("scored rows", False))
            for side, logprobs in sides if rep % 2 == 0 else sides[::-1]:
                wall, cpu, results = score_pass(
                    clients["dense"],
                    heavy,
                    pids["dense"],
                    losses=common.LOSSES,
                    return_logprobs=logprobs,
                )
                runs["response-only"][side].append((wall, cpu))
                last[("response-only", side)] = results
                logger.info("response-only %s: %.1f s wall, %.1f s CPU", side, wall, cpu)
        peaks = {k: procfs.status_kib(p, "VmHWM") / 1024 for k, p in pids.items()}
        for client in clients.values():
            client.close()
    finally:
        for server in servers.values():
            server.stop()

    def max_diff(name: str, a: str, b: str, field: str) -> float:
        return max(
            float(np.abs(np.asarray(x) - np.asarray(y)).max())
            for ra, rb in zip(last[(name, a)], last[(name, b)], strict=True)
            for x, y in zip(getattr(ra, field), getattr(rb, field), strict=True)
        )

    rows = {}
    for name, (base, fast) in (
        ("grpo", ("dense", "shared")),
        ("agentic", ("dense", "shared")),
        ("response-only", ("all rows", "scored rows")),
    ):
        runs_b, runs_f = runs[name][base], runs[name][fast]
        cpu_ratios = [b[1] / f[1] for b, f in zip(runs_b, runs_f, strict=True)]
        wall_ratios = [b[0] / f[0] for b, f in zip(runs_b, runs_f, strict=True)]
        groups = workloads.get(name, heavy)
        n_tok = tokens(groups)
        field = "logprobs" if name != "response-only" else None
        rows[name] = {
            "groups": groups,
            "tokens": n_tok,
            "sides": (base, fast),
            "ratio": statistics.median(cpu_ratios),
            "ratios": cpu_ratios,
            "wall_ratio": statistics.median(wall_ratios),
            "tps": {
                side: n_tok / statistics.median(c for _, c in runs[name][side])
                for side in (base, fast)
            },
            "wall_tps": {
                side: n_tok / statistics.median(w for w, _ in runs[name][side])
                for side in (base, fast)
            },
            "diff": max_diff(name, base, fast, field) if field else None,
            "loss_diff": max(
                float(
                    np.abs(a.loss["nll"] - b.loss["nll"]).max()
                    / max(1.0, np.abs(a.loss["nll"]).max())
                )
                for a, b in zip(last[(name, base)], last[(name, fast)], strict=True)
            ),
        }
    return {"rows": rows, "peaks": peaks}


def describe(name: str, groups: list[Group], args) -> str:
    lens = np.array([len(s) for g in groups for s in g.sequences])
    head = {
        "grpo": f"{len(groups)} prompts x n = {N} (issue: 16 x 8); prompt and response "
        "log-normal median 512, sigma 0.8, prompts clipped to [64, 2048], responses to "
        f"[16, 2048]; seed {args.seed}",
        "agentic": f"{len(groups)} histories of {args.history_len} tokens x {N} turns "
        f"(issue: 8 histories of 8k x 8 turns of ~512, same 16 : 1 ratio at a quarter of "
        f"the length); turns log-normal median "
        f"{args.turn_len}, sigma 0.3, clipped to [64, 1024]",
        "response-only": f"{args.heavy} distinct prompts (log-normal median 768, sigma 0.5, "
        "[256, 2048]) + one response each (median 128, sigma 0.5, [16, 512]), in requests "
        "of 8; loss mask on the responses",
    }[name]
    return (
        f"{head}: {len(lens)} sequences, {int(lens.sum())} tokens, length min {lens.min()} "
        f"median {int(np.median(lens))} max {lens.max()}"
    )


def section(res: dict, args, elapsed: float, load_start: str, load_end: str) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    rows = res["rows"]
    lines = [
        BEGIN,
        "## Shared prefixes and scored rows (`bench/prefix_sharing.py`)",
        "",
        f"Written by `python bench/prefix_sharing.py --reps {args.reps}` in "
        f"{elapsed / 60:.1f} min ({now}, load average {load_start} at the start, "
        f"{load_end} at the end); rerun it to update this section.",
        "",
        "* model `bench` (CPU, float32, vocab 32000), two `megascore serve` subprocesses: "
        "`--no-prefix-sharing` (dense) and prefix sharing on (`--min-shared-prefix 16`), "
        f"both `--max-tokens-per-batch {MAX_TOKENS}` and `--no-prefix-cache`; SDK client, "
        "one request per group, "
        f"{IN_FLIGHT} in flight, servers taking turns, order alternating per repetition",
        *(f"* workload `{name}`: {describe(name, rows[name]['groups'], args)}" for name in rows),
        "* ratio: dense-equivalent tokens (full sequence lengths) per server CPU second, "
        "fast side / slow side, median over repetitions (wall-clock ratio beside it); peak "
        f"RSS dense {res['peaks']['dense']:.0f} MiB, shared {res['peaks']['shared']:.0f} MiB",
        "",
        "| workload | compared | value | target | result | measured |",
        "|---|---|---:|---|---|---|",
    ]
    met = 0
    for name, row in rows.items():
        base, fast = row["sides"]
        ok = row["ratio"] >= TARGETS[name]
        met += ok
        diff = f"; max abs logprob diff {row['diff']:.1e}" if row["diff"] is not None else ""
        if name != "response-only":  # the bound: tokens computed dense / shared
            computed = computed_tokens(row["groups"])
            diff += (
                f"; tokens computed dense {row['tokens']} / shared {computed} = "
                f"{row['tokens'] / computed:.2f}"
            )
        lines.append(
            f"| {name} | {fast} / {base} | {row['ratio']:.2f} | >= {TARGETS[name]} | "
            f"{'pass' if ok else 'MISS'} | {fast} {row['tps'][fast]:.0f} / {base} "
            f"{row['tps'][base]:.0f} dense-equivalent tokens per CPU s (reps "
            f"{min(row['ratios']):.2f}..{max(row['ratios']):.2f}); wall {fast} "
            f"{row['wall_tps'][fast]:.0f} / {base} {row['wall_tps'][base]:.0f} tokens/s = "
            f"{row['wall_ratio']:.2f}{diff}; NLL max rel diff {row['loss_diff']:.1e} |"
        )
    lines += ["", f"{met} of {len(rows)} targets met.", END]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--histories", type=int, default=2)
    p.add_argument("--history-len", type=int, default=2048)
    p.add_argument("--turn-len", type=int, default=128)
    p.add_argument("--heavy", type=int, default=32, help="prompts of the response-only mix")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    common.quiet_logs()
    start, load_start = time.time(), common.load_average()
    with tempfile.TemporaryDirectory() as tmp:
        res = measure(args, Path(tmp))
    text = section(res, args, time.time() - start, load_start, common.load_average())
    common.write_section(args.output, BEGIN, END, text)
    print(text)


if __name__ == "__main__":
    main()

"""Shared prefixes on a grid of shapes, with MoE metrics, and an RL batch far over one step.

Each workload is scored through gRPC (SDK, one request per group, 2 in flight) by two
``megascore serve`` subprocesses of one model at the **default**
``--max-tokens-per-batch`` (16384): ``--no-prefix-sharing`` (dense) and prefix
sharing on (``--prefix-sharing``, ``--min-shared-prefix 16``); the two take turns,
the order alternating per workload. The measure is dense-equivalent tokens per server
CPU second, shared over dense; its **ideal** is the workload's dense tokens over the
rows the shared server computes for it (the segments of the prefix tree, lead rows
included), printed beside it with their quotient (the efficiency).

1. **grid** (model ``bench``, float32): prompt medians 128 / 512 / 2k / 8k x response
   medians 32 / 256 / 1k x n = 4 / 8 / 16 (log-normal lengths, sigma 0.3), as many
   prompts per cell as make about ``--cell-tokens`` dense tokens (at least one), and
   agentic histories of 2k and 8k x 8 turns of 128 and 512, two histories per cell;
   every length divided by ``--scale`` (default 4: the bench model's positions end at
   4096, and a 2-core CPU scores the grid in about a quarter of an hour at a quarter
   of the length). Targets: every cell >= 80 % of its ideal, the median cell >= 90 %.
2. **moe-metrics** (``tiny-moe``): GRPO 8 prompts x n = 8, prompts and responses of
   median 512, with ``metrics=("moe", "mtp")``. Target: shared >= 1.6x dense.
3. **rl-batch** (``tiny``): one GRPO request of ``--rl-tokens`` dense tokens (default
   1M; n = 8, prompt and response medians 256, each sequence within the model's 1024
   positions), far over one step at the default budget. Target >= 85 % of its ideal.

Usage: ``python bench/prefix_grid.py [--scale 4] [--rl-tokens 1048576] [--output
bench/RESULTS.md]`` writes (or replaces) the section between the ``prefix_grid.py``
markers of RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import statistics
import tempfile
import time
from pathlib import Path

import common
import numpy as np
from e2e_vs_engine import start_server
from prefix_sharing import (
    Group,
    _groups,
    _lognormal,
    attention_ratio,
    computed_tokens,
    score_pass,
    tokens,
)

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
BEGIN, END = "<!-- prefix_grid.py: begin -->", "<!-- prefix_grid.py: end -->"
DEFAULT_BUDGET = 16384
TINY_VOCAB = 512  # tiny and tiny-moe
PROMPTS, RESPONSES, NS = (128, 512, 2048, 8192), (32, 256, 1024), (4, 8, 16)
HISTORIES, TURNS = (2048, 8192), (128, 512)
CELL_TARGET, MEDIAN_TARGET, MOE_TARGET, RL_TARGET = 0.8, 0.9, 1.6, 0.85


def grpo_cell(
    rng, prompts: int, n: int, prompt: int, response: int, limit: int, vocab: int = 32000
) -> list[Group]:
    """``prompts`` groups of ``n``: log-normal lengths (sigma 0.3) around the medians,
    each sequence within ``limit`` positions, ids below ``vocab``."""
    p_lens = _lognormal(rng, prompts, prompt, 0.3, 1, limit // 2)
    r_lens = [_lognormal(rng, n, response, 0.3, 1, limit - int(p)) for p in p_lens]
    return [Group([s % vocab for s in g.sequences], g.masks) for g in _groups(rng, p_lens, r_lens)]


def grid_cells(scale: int, cell_tokens: int, seed: int) -> dict[str, list[Group]]:
    """The grid's workloads by name (lengths divided by ``scale``)."""
    rng = np.random.default_rng(seed)
    cells = {}
    for p in PROMPTS:
        for r in RESPONSES:
            for n in NS:
                prompt, response = p // scale, max(1, r // scale)
                count = max(1, round(cell_tokens / (n * (prompt + response))))
                groups = grpo_cell(rng, count, n, prompt, response, 4096)
                cells[f"grpo {p}/{r} n={n}"] = groups
    for h in HISTORIES:
        for t in TURNS:
            turns = [_lognormal(rng, 8, t // scale, 0.3, 1, 1024) for _ in range(2)]
            cells[f"agentic {h} x 8 x {t}"] = _groups(rng, [h // scale] * 2, turns)
    return cells


def run_pair(model: str, workloads: dict, workdir: Path, **options) -> dict:
    """Scores each workload on a dense and a shared server; per workload ``(dense CPU s,
    shared CPU s, max abs logprob diff)``."""
    from megascore_client import ScoringClient

    servers = {
        "dense": start_server(
            "cpu", DEFAULT_BUDGET, workdir / f"{model}-dense.log", model, ("--no-prefix-sharing",)
        ),
        "shared": start_server(
            "cpu", DEFAULT_BUDGET, workdir / f"{model}-shared.log", model, ("--prefix-sharing",)
        ),
    }
    out = {}
    try:
        for server in servers.values():
            server.wait_serving(600)
        clients = {k: ScoringClient(s.target, timeout=3600) for k, s in servers.items()}
        pids = {k: s.proc.pid for k, s in servers.items()}
        first = next(iter(workloads.values()))[:1]
        for side in servers:  # warm-up
            score_pass(clients[side], first, pids[side], **options)
        for i, (name, groups) in enumerate(workloads.items()):
            cpu, last = {}, {}
            for side in ("dense", "shared") if i % 2 == 0 else ("shared", "dense"):
                _, cpu[side], last[side] = score_pass(clients[side], groups, pids[side], **options)
            diff = max(
                float(np.abs(np.asarray(x) - np.asarray(y)).max())
                for a, b in zip(last["dense"], last["shared"], strict=True)
                for x, y in zip(a.logprobs, b.logprobs, strict=True)
            )
            out[name] = (cpu["dense"], cpu["shared"], diff)
            logger.info("%s: dense %.1f / shared %.1f CPU s", name, cpu["dense"], cpu["shared"])
        for client in clients.values():
            client.close()
    finally:
        for server in servers.values():
            server.stop()
    return out


def row(name: str, groups: list[Group], measured: tuple, target: str, ok: bool) -> str:
    dense_s, shared_s, diff = measured
    n_tok, rows = tokens(groups), computed_tokens(groups)
    ratio, ideal = dense_s / shared_s, n_tok / rows
    return (
        f"| {name} | {n_tok} | {rows} | {ideal:.2f} | {attention_ratio(groups):.2f} | "
        f"{ratio:.2f} | {ratio / ideal:.0%} | {target} | {'pass' if ok else 'MISS'} | {diff:.1e} |"
    )


def efficiency(groups: list[Group], measured: tuple) -> float:
    return (measured[0] / measured[1]) / (tokens(groups) / computed_tokens(groups))


def measure(args, workdir: Path) -> list[str]:
    lines = []
    cells = grid_cells(args.scale, args.cell_tokens, args.seed)
    grid = run_pair("bench", cells, workdir, return_logprobs=True)
    effs = [efficiency(cells[name], grid[name]) for name in cells]
    median = statistics.median(effs)
    lines.append(
        f"Grid (`bench`, lengths / {args.scale}): {sum(e >= CELL_TARGET for e in effs)} of "
        f"{len(effs)} cells >= {CELL_TARGET:.0%} of their ideal (min {min(effs):.0%}); "
        f"median cell {median:.0%} (target >= {MEDIAN_TARGET:.0%}: "
        f"{'pass' if median >= MEDIAN_TARGET else 'MISS'})."
    )
    lines += ["", *HEADER]
    for name, groups in cells.items():
        eff = efficiency(groups, grid[name])
        lines.append(row(name, groups, grid[name], f">= {CELL_TARGET:.0%}", eff >= CELL_TARGET))
    rng = np.random.default_rng(args.seed)
    moe = {"moe-metrics": grpo_cell(rng, 8, 8, 512, 512, 1024, TINY_VOCAB)}
    got = run_pair("tiny-moe", moe, workdir, return_logprobs=True, metrics=("moe", "mtp"))
    ratio = got["moe-metrics"][0] / got["moe-metrics"][1]
    lines.append(row("moe-metrics (tiny-moe)", moe["moe-metrics"], got["moe-metrics"],
                     f">= {MOE_TARGET}x", ratio >= MOE_TARGET))  # fmt: skip
    groups = []
    while sum(len(s) for g in groups for s in g.sequences) < args.rl_tokens:
        groups += grpo_cell(rng, 1, 8, 256, 256, 1024, TINY_VOCAB)
    rl = {"rl-batch": [Group([s for g in groups for s in g.sequences],
                             [m for g in groups for m in g.masks])]}  # fmt: skip
    got = run_pair("tiny", rl, workdir, return_logprobs=True)
    eff = efficiency(rl["rl-batch"], got["rl-batch"])
    lines.append(row(f"rl-batch (tiny, one request of {len(groups)} groups)", rl["rl-batch"],
                     got["rl-batch"], f">= {RL_TARGET:.0%}", eff >= RL_TARGET))  # fmt: skip
    return lines


HEADER = (
    "| workload | dense tokens | shared rows | ideal | attention ideal | shared / dense (CPU s) "
    "| of ideal | target | result | max abs logprob diff |",
    "|---|---:|---:|---:|---:|---:|---:|---|---|---:|",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=int, default=4, help="divide the grid's lengths by this")
    p.add_argument("--cell-tokens", type=int, default=8192, help="dense tokens per grid cell")
    p.add_argument("--rl-tokens", type=int, default=1 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    common.quiet_logs()
    start, load_start = time.time(), common.load_average()
    with tempfile.TemporaryDirectory() as tmp:
        lines = measure(args, Path(tmp))
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join(
        [
            BEGIN,
            "## Shared prefixes on a grid of shapes (`bench/prefix_grid.py`)",
            "",
            f"Written by `python bench/prefix_grid.py --scale {args.scale} --cell-tokens "
            f"{args.cell_tokens} --rl-tokens {args.rl_tokens}` in "
            f"{(time.time() - start) / 60:.1f} min ({now}, load average "
            f"{load_start} at the start, {common.load_average()} at the end); rerun it to "
            "update this section. What is measured: the module docstring; ideal = dense "
            "tokens / shared rows.",
            "",
            *lines,
            END,
        ]
    )
    common.write_section(args.output, BEGIN, END, text)
    print(text)


if __name__ == "__main__":
    main()

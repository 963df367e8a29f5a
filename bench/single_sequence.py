"""One long sequence through gRPC vs a transformers forward + log-softmax (issue 23).

A random transformers ``LlamaForCausalLM`` (hidden 256, 4 layers, vocab 32000, float32)
is saved to a temporary directory and served by ``megascore serve --model hf:DIR``
(CPU, one process). For each length (default 2048 and 16384 tokens), one random
sequence is scored, the two sides taking turns (the order alternating per repetition):

* **megascore**: the SDK's ``score([sequence], losses=())`` through gRPC, wall clock
  from the call to the decoded result (client encode, wire, batching, the packed
  forward with its chunked vocabulary head, response);
* **transformers**: in this process, ``model(ids).logits`` then ``log_softmax`` over
  the vocabulary and the gather of the next tokens' logprobs: what a trainer's
  reference-logprob code does for one sequence; once with transformers' default
  attention (``sdpa``: torch's CPU flash attention, the kernel megascore's attention
  calls too; the judged row) and once with ``eager`` (the score matrix materialised;
  transformers' default before SDPA, a reference point, not judged).

Both sides use every core of the machine (the server and this process run one at a
time). The ratio is transformers seconds / megascore seconds, the median over the
repetitions (targets: >= 1.0 at 2k tokens, >= 2.0 at 16k), with the max |delta
logprob| between the two.

Usage: ``python bench/single_sequence.py [--lengths 2048,16384] [--reps 3]
[--attention sdpa,eager]`` writes (or
replaces) the section between the ``single_sequence.py`` markers of RESULTS.md.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from pathlib import Path

import common
import numpy as np
from e2e_vs_engine import start_server

HERE = Path(__file__).parent
BEGIN, END = "<!-- single_sequence.py: begin -->", "<!-- single_sequence.py: end -->"
VOCAB, HIDDEN, LAYERS = 32000, 256, 4
TARGETS = {2048: 1.0, 16384: 2.0}
JUDGED = "sdpa"  # transformers' default attention


def make_model(max_len: int):
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=688,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def transformers_logprobs(model, seq: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        ids = torch.from_numpy(seq)[None]
        lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        return lp[:-1].gather(-1, ids[0, 1:, None])[:, 0].numpy()


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def measure(tmp: Path, lengths: list[int], reps: int, attentions: list[str]) -> dict:
    import torch

    from megascore_client import ScoringClient

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    model = make_model(max(lengths))
    model.save_pretrained(tmp / "llama")
    rng = np.random.default_rng(0)
    seqs = {n: rng.integers(0, VOCAB, n) for n in lengths}
    server = start_server("cpu", max(lengths), tmp / "server.log", model=f"hf:{tmp / 'llama'}")
    rows: dict[tuple[int, str], dict] = {}
    try:
        server.wait_serving(timeout=900)
        with ScoringClient(server.target, timeout=1800, retries=None) as client:
            for (n, seq), attention in itertools.product(seqs.items(), attentions):
                model.set_attn_implementation(attention)
                client.score([seq[:64]], losses=())  # warm-up: first-call costs
                transformers_logprobs(model, seq[:64])
                sides = {  # each: the logprobs of tokens 1 .. n-1
                    "ms": lambda s=seq: client.score([s], losses=()).logprobs[0][1:],
                    "hf": lambda s=seq: transformers_logprobs(model, s),
                }
                seconds: dict[str, list[float]] = {"ms": [], "hf": []}
                diff = 0.0
                for rep in range(reps):
                    got = {}
                    for name in ("ms", "hf") if rep % 2 == 0 else ("hf", "ms"):
                        took, got[name] = timed(sides[name])
                        seconds[name].append(took)
                    diff = max(diff, float(np.abs(got["ms"].astype(np.float64) - got["hf"]).max()))
                ours, theirs = seconds["ms"], seconds["hf"]
                ratios = [h / m for h, m in zip(theirs, ours, strict=True)]
                rows[n, attention] = dict(ms=ours, hf=theirs, ratios=ratios, diff=diff)
                print(f"{n} tokens: megascore {ours} s, transformers ({attention}) {theirs} s")
    finally:
        server.stop()
    return rows


def section(rows: dict, machine: dict, elapsed: float, reps: int, start_load: str) -> str:
    lines = [
        BEGIN,
        "## One sequence through gRPC vs transformers (`bench/single_sequence.py`)",
        "",
        f"Written by `python bench/single_sequence.py --reps {reps}` in {elapsed / 60:.1f} min "
        f"({machine['date']}, {machine['cpu']}, {machine['torch']}, "
        f"load average {start_load} at the start, {common.load_average()} at the end); rerun "
        "it to update this section.",
        "",
        f"* model: random transformers LlamaForCausalLM, hidden {HIDDEN}, {LAYERS} layers, "
        f"vocab {VOCAB}, float32, served as `hf:DIR` by one `megascore serve` (CPU)",
        "* megascore: SDK `score([seq], losses=())` through gRPC, wall clock; transformers: "
        "`model(ids).logits`, `log_softmax`, gather, in-process; sides alternate per "
        "repetition, every core each",
        "",
        "| tokens | transformers attention | megascore s (median) | transformers s (median) "
        "| transformers / megascore | target | result | max abs logprob diff |",
        "|---:|---|---:|---:|---:|---|---|---:|",
    ]
    met = 0
    for (n, attention), row in rows.items():
        ratio = statistics.median(row["ratios"])
        target = TARGETS.get(n) if attention == JUDGED else None
        ok = target is not None and ratio >= target
        met += ok
        result = "-" if target is None else ("pass" if ok else "MISS")
        ms, hf = statistics.median(row["ms"]), statistics.median(row["hf"])
        lines.append(
            f"| {n} | {attention} | {ms:.3f} | {hf:.3f} "
            f"| {ratio:.2f} (reps {min(row['ratios']):.2f}..{max(row['ratios']):.2f}) "
            f"| {'' if target is None else f'>= {target}'} | {result} | {row['diff']:.1e} |"
        )
    judged = sum(n in TARGETS and attention == JUDGED for n, attention in rows)
    lines += ["", f"{met} of {judged} targets met.", END]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,16384")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--attention", default="sdpa,eager", help="transformers attentions to time")
    p.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    start_load = common.load_average()
    common.run_own_section(
        "megascore-single-",
        (BEGIN, END),
        args.output,
        lambda tmp: measure(tmp, lengths, args.reps, args.attention.split(",")),
        lambda rows, machine, elapsed: section(rows, machine, elapsed, args.reps, start_load),
    )


if __name__ == "__main__":
    main()

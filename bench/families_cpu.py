"""Tokens/s of a tiny DeepSeek-V3 vs the same-size Llama, served from ``hf:DIR`` on the CPU.

Both checkpoints are random ``transformers`` models saved to a temporary directory and
loaded by the in-process engine (one rank, fp32, the "torch" attention backend) exactly
as ``megascore serve --model hf:DIR`` loads them. Same hidden size, layers, heads,
vocabulary and dense MLP width; DeepSeek-V3 adds what makes it DeepSeek-V3: multi-latent
attention (query LoRA, key/value latent, YaRN), a dense first layer, then MoE layers of
8 routed experts (top-2, sigmoid router with correction bias and 2 groups) plus a
shared expert (its MTP layer is loaded but not run: scoring skips it). Parameter counts,
total and active per token, are reported with the speeds.

Workload: the rollout length mix of ``bench/common.py`` (log-normal, median 200, clipped
to 512) in token-budget steps of 4096 tokens, logprobs + top-5 + NLL; the two models run
(each engine built for its run) in alternating order for ``--reps`` repetitions; the
value is the median ratio. Before timing, each model's logprobs are checked against
transformers on 4 sequences.

    python bench/families_cpu.py [--reps 3] [--num 24]

Writes (or replaces) the "Model families" section of ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import common
import numpy as np
from common import (
    create_engine,
    engine_pass,
    machine_info,
    make_workloads,
    quiet_logs,
    score_batch,
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # testkit.checkpoints (MTP layers)
MAX_TOKENS = 4096
SECTION = "## Model families (`bench/families_cpu.py`)"
BEGIN, END = "<!-- families_cpu.py: begin -->", "<!-- families_cpu.py: end -->"

DIMS = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    intermediate_size=688,
    vocab_size=8192,
    max_position_embeddings=1024,
)


def hf_configs():
    import transformers

    llama = transformers.LlamaConfig(**DIMS)
    deepseek = transformers.DeepseekV3Config(
        **DIMS,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=1,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256
        ),
    )
    return {"llama": llama, "deepseek_v3": deepseek}


def active_parameters(model, cfg) -> int:
    """Parameters one token uses: everything but the routed experts it is not sent to."""
    total = sum(p.numel() for p in model.parameters())
    experts = getattr(cfg, "n_routed_experts", 0) or 0
    if not experts:
        return total
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total - routed + routed * cfg.num_experts_per_tok // experts


def save(root: Path) -> dict[str, tuple[Path, object, int, int]]:
    import torch
    import transformers

    from testkit.checkpoints import save_hf_model

    out = {}
    for family, cfg in hf_configs().items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        directory = root / family
        save_hf_model(model, family, directory)
        total = sum(p.numel() for p in model.parameters())
        out[family] = (directory, model, total, active_parameters(model, cfg))
    return out


def check_logprobs(engine, model, sequences) -> float:
    """Max |engine - transformers| target logprob over ``sequences``."""
    import torch

    res = engine.score(score_batch(sequences))
    parts = np.split(res.logprobs, np.cumsum([len(s) for s in sequences])[:-1])
    worst = 0.0
    with torch.no_grad():
        for seq, got in zip(sequences, parts, strict=True):
            ids = torch.as_tensor(seq)[None]
            lp = torch.log_softmax(model(ids).logits[0].double(), -1)[:-1]
            ref = lp.gather(-1, ids[0, 1:, None])[:, 0].numpy()
            worst = max(worst, float(np.abs(got[1:] - ref).max(initial=0.0)))
    return worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--num", type=int, default=24, help="sequences in the workload")
    p.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args()
    quiet_logs()
    machine = machine_info("cpu")
    workload, _ = make_workloads(args.num, 0, DIMS["vocab_size"], median=200.0, max_len=512)
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = save(Path(tmp))
        speeds: dict[str, list[float]] = {f: [] for f in ckpts}
        check: dict[str, float] = {}
        for rep in range(args.reps):  # one engine per process at a time: rebuilt per run
            for family in list(ckpts) if rep % 2 == 0 else list(reversed(ckpts)):
                directory, model = ckpts[family][:2]
                engine = create_engine("cpu", f"hf:{directory}")
                try:
                    if family not in check:
                        check[family] = check_logprobs(engine, model, workload.sequences[:4])
                    engine_pass(engine, workload.subset([0, 1]), MAX_TOKENS)  # warm-up
                    run = engine_pass(engine, workload, MAX_TOKENS)
                    speeds[family].append(workload.num_tokens / run.seconds)
                finally:
                    engine.shutdown()
    ratios = [d / lm for d, lm in zip(speeds["deepseek_v3"], speeds["llama"], strict=True)]
    med = {f: float(np.median(v)) for f, v in speeds.items()}
    rows = [
        f"| {f} | {ckpts[f][2] / 1e6:.2f}M | {ckpts[f][3] / 1e6:.2f}M | {med[f]:.0f} "
        f"({min(speeds[f]):.0f}..{max(speeds[f]):.0f}) | {check[f]:.1e} |"
        for f in ckpts
    ]
    text = "\n".join(
        [
            BEGIN,
            SECTION,
            "",
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {machine['cpu']}, load "
            f"{machine['load average']}, torch {machine['torch']}; workload "
            f"{workload.summary()}; {args.reps} alternating repetitions.",
            "",
            "| model (`hf:DIR`) | parameters | active / token | tokens/s (min..max) "
            "| max abs logprob diff vs transformers |",
            "|---|---:|---:|---:|---:|",
            *rows,
            "",
            f"**deepseek_v3 / llama tokens/s: {float(np.median(ratios)):.2f}** "
            f"(reps {min(ratios):.2f}..{max(ratios):.2f}). Same hidden size, layers, heads and "
            "vocabulary; MLA + 8 experts top-2 + a shared expert in 3 of 4 layers.",
            END,
        ]
    )
    print(text)
    common.write_section(args.output, BEGIN, END, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

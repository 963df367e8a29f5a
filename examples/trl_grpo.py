#!/usr/bin/env python
"""TRL's GRPOTrainer with its reference model served by megascore, checked against TRL's own.

Trains a tiny random Llama (saved with ``save_pretrained``, with a word-level tokenizer)
for ``--steps`` GRPO steps with ``beta > 0`` and a toy reward, twice from the same seed:

1. ``trl.GRPOTrainer``: TRL's local reference model (a second copy of the weights);
2. ``megascore_client.trl_grpo.MegascoreGRPOTrainer``: no reference model in the
   trainer; the reference logprobs come from a megascore server serving the saved
   initial weights.

and prints, per step, how far apart the two runs' per-token reference logprobs (on the
completion tokens) and losses are.

``--lora``: both runs train a peft LoRA adapter (TRL's ``peft_config``) over the same
weights; TRL's reference is then its base (the adapter disabled), and megascore's comes
from the one server holding the base: before each generation batch the trainer pushes
its adapter to the server (``push_adapter``, served as ``policy-lora``) and one call
(``model="policy-lora", reference=`` the base) gives the old policy's logprobs (the
adapter's) and the reference's. Printed besides: the served reference against a local
forward of the base, and the served adapter against a local transformers + peft
forward of the trainer's model at the weights it pushed.

``--launch`` starts the server here (``megascore serve --model hf:DIR`` on a free port,
stopped at the end); otherwise give
``--reference`` (a server started from ``--init-dir``, which holds the model and its
tokenizer).

Needs: pip install 'megascore[trl,server]' (TRL and its transformers for the trainer,
the server for ``--launch``; in a checkout: ``pip install -e '.[trl,server]'``). The
commands below assume the virtual environment is active (``source .venv/bin/activate``)::

    python examples/trl_grpo.py --launch
    python examples/trl_grpo.py --launch --lora
    python examples/trl_grpo.py --init-dir /ckpt/init --reference host:50051
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import datasets
import peft
import tokenizers
import torch
import transformers
import trl
from grpo_loop import launched_servers, tiny_llama

from megascore_client import ScoringClient
from megascore_client.trl_grpo import MegascoreGRPOTrainer, RemoteReference

SPECIAL = ["<pad>", "<eos>", "<unk>"]
ADAPTER = "policy-lora"  # the served name of the trainer's adapter (--lora)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--launch", action="store_true", help="start the reference server here")
    parser.add_argument("--init-dir", default=None, help="the saved model (+ tokenizer) served")
    parser.add_argument("--reference", default=None, help="reference server (initial weights)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--completion-len", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora", action="store_true", help="train a peft LoRA adapter")
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="one JSON line per step")
    return parser.parse_args(argv)


def save_tiny_model(directory: Path, seed: int) -> None:
    """A tiny random Llama and a word-level tokenizer (``w3`` .. ``w255``) in ``directory``."""
    model = tiny_llama(seed)
    with torch.no_grad():
        model.lm_head.weight[1].mul_(3.0)  # <eos> is likelier: some completions end early
    vocab = {token: i for i, token in enumerate(SPECIAL)}
    vocab |= {f"w{i}": i for i in range(len(SPECIAL), model.config.vocab_size)}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def prompts(seed: int, count: int = 8) -> datasets.Dataset:
    """Prompts of 2 to 6 words (left padding happens)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        n = int(torch.randint(2, 7, (1,), generator=gen))
        rows.append(" ".join(f"w{int(i)}" for i in torch.randint(3, 256, (n,), generator=gen)))
    return datasets.Dataset.from_dict({"prompt": rows})


def low_words(completions, **_) -> list[float]:
    """Toy reward: the share of completion words below ``w32``."""
    return [
        sum(int(w[1:]) < 32 for w in c.split() if w[1:].isdigit()) / max(len(c.split()), 1)
        for c in completions
    ]


def recording(base: type) -> type:
    """``base`` that keeps, per step, the completions, their reference logprobs and the loss;
    with a peft model also the old policy's logprobs it was given (if any) and a local
    forward of the model (``peft``) and of its base (``base``) at the generating weights."""

    class Recording(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.steps: list[dict] = []

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            keys = ("completion_ids", "completion_mask", "ref_per_token_logps")
            self.steps.append({k: out[k] for k in keys})
            if hasattr(self.model, "disable_adapter"):
                self.steps[-1]["old_per_token_logps"] = out.get("old_per_token_logps")
                self.steps[-1] |= self.local_forwards(out)
            return out

        def local_forwards(self, out) -> dict:
            """This process's transformers (+ peft) logprobs of the completions."""
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
            mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
            width = out["completion_ids"].shape[1]
            forward = trl.GRPOTrainer._get_per_token_logps_and_entropies
            with torch.no_grad():
                peft_logps = forward(self, self.model, ids, mask, width)[0]
                with self.model.disable_adapter():
                    base_logps = forward(self, self.model, ids, mask, width)[0]
            return {"peft": peft_logps, "base": base_logps}

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.steps[-1]["loss"] = float(loss.detach())
            return loss

    return Recording


def train(base: type, init_dir: Path, out_dir: Path, args, **extra) -> trl.GRPOTrainer:
    config = trl.GRPOConfig(
        output_dir=str(out_dir),
        beta=args.beta,
        learning_rate=args.lr,
        max_steps=args.steps,
        per_device_train_batch_size=8,  # 2 prompts (of different lengths) x 4
        num_generations=4,
        max_completion_length=args.completion_len,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=args.seed,
        disable_tqdm=True,
        bf16=False,  # TRL defaults to bf16 autocast; the server here scores in fp32
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32)
    if args.lora:  # TRL wraps the model (get_peft_model); its reference is then the base
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        extra["peft_config"] = peft.LoraConfig(
            r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=targets, lora_dropout=0.0
        )
    tokenizer = transformers.AutoTokenizer.from_pretrained(init_dir)
    trainer = recording(base)(
        model=model,
        reward_funcs=low_words,
        args=config,
        train_dataset=prompts(args.seed),
        processing_class=tokenizer,
        **extra,
    )
    trainer.remove_callback(transformers.PrinterCallback)  # its per-step log dicts
    trainer.train()
    return trainer


def max_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """max |a - b| over the completion tokens."""
    return float((a - b)[mask].abs().max())


def lora_columns(local: dict, served: dict, mask: torch.Tensor) -> dict:
    """The LoRA path's checks of one step: the served reference against the base, the
    served old policy (the pushed adapter) against peft, and how far the adapter moved."""
    return {
        "local_old_logps": local["old_per_token_logps"] is not None,  # TRL's aligned steps
        "ref_vs_base_max_abs_diff": max_gap(served["ref_per_token_logps"], served["base"], mask),
        "local_ref_vs_base_max_abs_diff": max_gap(
            local["ref_per_token_logps"], local["base"], mask
        ),
        "policy_vs_peft_max_abs_diff": max_gap(served["old_per_token_logps"], served["peft"], mask),
        "policy_vs_reference_max_abs_diff": max_gap(
            served["old_per_token_logps"], served["ref_per_token_logps"], mask
        ),
    }


def compare(local: trl.GRPOTrainer, served: trl.GRPOTrainer) -> list[dict]:
    """Per step: same completions, the gaps of reference logprobs and losses, the KL (and
    with a peft model :func:`lora_columns`)."""
    rows = []
    kls = [log["kl"] for log in served.state.log_history if "kl" in log]
    for step, (a, b) in enumerate(zip(local.steps, served.steps, strict=True)):
        same = torch.equal(a["completion_ids"], b["completion_ids"])
        mask = a["completion_mask"].bool()
        gap = max_gap(a["ref_per_token_logps"], b["ref_per_token_logps"], mask)
        rows.append(
            {
                "step": step,
                "same_completions": same,
                "completion_tokens": int(mask.sum()),
                "ref_logprob_max_abs_diff": float(gap),
                "loss_local": a["loss"],
                "loss_megascore": b["loss"],
                "loss_abs_diff": abs(a["loss"] - b["loss"]),
                "kl": kls[step],
            }
            | (lora_columns(a, b, mask) if "peft" in b else {})
        )
    return rows


def quiet() -> None:
    """Only this script's result lines: TRL / transformers warnings and notices off."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars
    datasets.logging.set_verbosity_error()


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet()
    with tempfile.TemporaryDirectory() as tmp:
        if args.launch:
            init_dir = Path(tmp) / "init"
            save_tiny_model(init_dir, args.seed)
            name = "base" if args.lora else "reference"
            servers = launched_servers(init_dir, Path(tmp), names=(name,))
        else:
            if not (args.init_dir and args.reference):
                raise SystemExit("give --launch, or --init-dir and --reference")
            init_dir = Path(args.init_dir)
            servers = contextlib.nullcontext([args.reference])
        with servers as (target,), ScoringClient(target, timeout=120) as reference:
            start = time.monotonic()
            reference.wait_until_serving(timeout=300)
            print(f"server ready in {time.monotonic() - start:.1f} s", file=sys.stderr)
            local = train(trl.GRPOTrainer, init_dir, Path(tmp) / "local", args)
            adapter = {"adapter": ADAPTER} if args.lora else {}
            served = train(
                MegascoreGRPOTrainer,
                init_dir,
                Path(tmp) / "served",
                args,
                reference=reference,
                **adapter,
            )
            served_models = {m.name: m.base for m in reference.model_info().models}
        assert isinstance(served.ref_model, RemoteReference)  # no reference weights held
        if args.lora:  # one server: the base set and the pushed adapter over it
            assert served_models == {"default": "", ADAPTER: "default"}, served_models
        for row in compare(local, served):
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"step {row['step']}: same completions {row['same_completions']}; "
                    f"reference logprobs max |TRL - megascore| "
                    f"{row['ref_logprob_max_abs_diff']:.1e} over {row['completion_tokens']} "
                    f"tokens; loss {row['loss_local']:.6f} vs {row['loss_megascore']:.6f} "
                    f"(|diff| {row['loss_abs_diff']:.1e}); KL {row['kl']:.4f}",
                    flush=True,
                )
                if args.lora:
                    print(
                        f"  served reference vs local base {row['ref_vs_base_max_abs_diff']:.1e}; "
                        f"served adapter vs local peft {row['policy_vs_peft_max_abs_diff']:.1e}; "
                        f"adapter vs base {row['policy_vs_reference_max_abs_diff']:.1e}",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

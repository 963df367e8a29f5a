#!/usr/bin/env python
"""A small GRPO loop on CPU: a transformers trainer; megascore old-policy + reference logprobs.

Each step:

1. the trainer (a tiny ``transformers`` LlamaForCausalLM) pushes its current weights
   into the *policy* replicas with ``client.push_weights`` (no checkpoint on disk; one
   push to every replica of the target, all or none);
2. samples ``--group`` responses for each of ``--prompts`` prompts from itself;
3. scores ``prompt + response`` on the policy replicas, round robin, pinned to the
   version just pushed (old-policy logprobs, which must equal the trainer's own: the
   train/score parity this prints) and on the *reference*
   server, which keeps the initial weights (reference logprobs);
4. computes group-normalised advantages (GRPO) from a toy reward (the share of
   response tokens below ``vocab / 8``), and takes ``--inner-steps`` AdamW steps on
   the clipped importance-ratio objective with a k3 KL penalty to the reference.

Both servers serve the trainer's architecture from its initial save (``hf:DIR``).
``--launch`` starts them here (``--policy-replicas`` policy replicas, default 2, and
one reference: ``megascore serve`` subprocesses on free ports, stopped at the end);
otherwise give ``--policy`` (one address, ``ipv4:a,b`` or a ``dns:///`` name of
several replicas) / ``--reference`` targets and the ``--init-dir`` all were started
from.

Needs: pip install 'megascore[examples]' (``transformers`` for the trainer, and the
server; in a checkout: ``pip install -e '.[examples]'``). The commands below assume
the virtual environment is active (``source .venv/bin/activate``)::

    python examples/grpo_loop.py --launch --steps 4
    python examples/grpo_loop.py --init-dir /ckpt/init --policy ipv4:10.0.0.5:50051,10.0.0.6:50051 \
        --reference host:50052

With megascore's layout (entry t of a sequence is log p(x_t | x_<t)), entry
``P + j`` of a scored rollout is the logprob of response token ``j``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from megascore_client import ScoringClient
from megascore_client.push.replicas import replica_targets


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--launch", action="store_true", help="start both servers here")
    parser.add_argument("--init-dir", default=None, help="the initial HF save both serve")
    parser.add_argument("--policy", default=None, help="policy replicas (weights pushed)")
    parser.add_argument("--policy-replicas", type=int, default=2, help="with --launch")
    parser.add_argument("--reference", default=None, help="reference server (fixed weights)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="responses per prompt")
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=12)
    parser.add_argument("--inner-steps", type=int, default=2, help="optimizer steps per batch")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--kl-coef", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON line per step")
    return parser.parse_args(argv)


def tiny_llama(seed: int) -> transformers.LlamaForCausalLM:
    """A tiny random Llama (weights scaled so that its logprobs are far from uniform)."""
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=256,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_((1.0 if "embed" in name else 2.0) / (0.02 * p.shape[-1] ** 0.5))
    return model.eval()


@contextlib.contextmanager
def launched_servers(init_dir: Path, log_dir: Path, names=("policy", "reference")):
    """One ``megascore serve --model hf:init_dir`` subprocess per name: their targets."""
    from megascore_server.ports import pick_port  # the server is installed with [examples]

    procs, targets = [], []
    try:
        for name in names:
            port = pick_port()
            log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
            cmd = [sys.executable, "-m", "megascore_server.main", "--model", f"hf:{init_dir}"]
            cmd += ["--host", "127.0.0.1", "--port", str(port), "--grace-s", "2"]
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
            targets.append(f"127.0.0.1:{port}")
        yield targets
    finally:
        for proc, log in procs:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


@contextlib.contextmanager
def launched_policy_and_reference(init_dir: Path, log_dir: Path, policy_replicas: int):
    """``policy_replicas`` policy servers and a reference server: (the policy replicas'
    ``ipv4:a,b`` target, the reference target)."""
    names = [f"policy{i}" for i in range(policy_replicas)] + ["reference"]
    with launched_servers(init_dir, log_dir, names) as targets:
        yield "ipv4:" + ",".join(targets[:-1]), targets[-1]


def sample(model, prompts: torch.Tensor, length: int, gen: torch.Generator) -> torch.Tensor:
    """Sampled continuations (temperature 1) of ``prompts`` [N, P] -> [N, length]."""
    ids = prompts
    with torch.no_grad():
        for _ in range(length):
            probs = torch.softmax(model(ids).logits[:, -1].double(), dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return ids[:, prompts.shape[1] :]


def response_logprobs(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Trainer logprobs of the response tokens: [N, R] (with grad)."""
    logp = torch.log_softmax(model(ids).logits[:, :-1].float(), dim=-1)
    target = logp.gather(-1, ids[:, 1:, None])[..., 0]  # [N, S-1]: log p(x_t | x_<t)
    return target[:, prompt_len - 1 :]


def served_logprobs(
    client: ScoringClient, ids: torch.Tensor, prompt_len: int, weights_version: str = ""
) -> torch.Tensor:
    """Server logprobs of the response tokens: [N, R] (megascore entry P + j)."""
    result = client.score(ids.numpy(), losses=(), weights_version=weights_version)
    return torch.from_numpy(np.stack([lp[prompt_len:] for lp in result.logprobs]))


def run(args, policy: ScoringClient, reference: ScoringClient, trainer) -> list[dict]:
    gen = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=args.lr)
    vocab, p_len = trainer.config.vocab_size, args.prompt_len
    history = []
    for step in range(args.steps):
        # 1. the current policy into the policy server
        pushed = policy.push_weights(
            trainer.state_dict().items(), weights_version=f"grpo-step{step}"
        )
        # 2. rollouts from the trainer
        prompts = torch.randint(0, vocab, (args.prompts, p_len), generator=gen)
        prompts = prompts.repeat_interleave(args.group, dim=0)  # [N, P], N = prompts x group
        ids = torch.cat([prompts, sample(trainer, prompts, args.response_len, gen)], dim=1)
        # 3. old-policy and reference logprobs from the servers
        old = served_logprobs(policy, ids, p_len, pushed.weights_version)
        ref = served_logprobs(reference, ids, p_len)
        with torch.no_grad():
            parity = float((response_logprobs(trainer, ids, p_len).double() - old).abs().max())
        # 4. GRPO: rewards, group-normalised advantages, clipped ratio + KL steps
        reward = (ids[:, p_len:] < vocab // 8).double().mean(dim=1)  # [N]
        grouped = reward.view(args.prompts, args.group)
        adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
        adv = adv.view(-1, 1).float()  # [N, 1]
        ratio_dev, kls = [], []
        trainer.train()
        for _ in range(args.inner_steps):
            new = response_logprobs(trainer, ids, p_len)  # [N, R]
            ratio = torch.exp(new - old.float())
            clipped = torch.clamp(ratio, 1 - args.clip, 1 + args.clip)
            delta = ref.float() - new
            kl = torch.exp(delta) - delta - 1  # k3 estimator of KL(policy || reference)
            loss = -torch.min(ratio * adv, clipped * adv).mean() + args.kl_coef * kl.mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ratio_dev.append(float((ratio.detach() - 1).abs().mean()))
            kls.append(float(kl.detach().mean()))
        trainer.eval()
        record = {
            "step": step,
            "weights_version": pushed.weights_version,
            "push_mb_per_s": pushed.bytes_per_s / 1e6,
            "train_score_parity": parity,
            "reward": float(reward.mean()),
            "kl_to_reference": kls[0],
            "ratio_mean_dev_first": ratio_dev[0],
            "ratio_mean_dev_last": ratio_dev[-1],
            "old_vs_ref_max": float((old - ref).abs().max()),
        }
        history.append(record)
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(
                f"step {step}: pushed {record['weights_version']} at "
                f"{record['push_mb_per_s']:.1f} MB/s; |trainer - server| {parity:.1e}; "
                f"reward {record['reward']:.3f}; KL {record['kl_to_reference']:.4f}; "
                f"mean |ratio - 1| first {ratio_dev[0]:.1e}, last {ratio_dev[-1]:.3f}",
                flush=True,
            )
    return history


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.launch:
            init_dir = Path(tmp) / "init"
            trainer = tiny_llama(args.seed)
            trainer.save_pretrained(init_dir)
            servers = launched_policy_and_reference(init_dir, Path(tmp), args.policy_replicas)
        else:
            if not (args.init_dir and args.policy and args.reference):
                raise SystemExit("give --launch, or --init-dir, --policy and --reference")
            trainer = transformers.LlamaForCausalLM.from_pretrained(args.init_dir).float().eval()
            servers = contextlib.nullcontext((args.policy, args.reference))
        with servers as (policy_target, reference_target):
            with (
                ScoringClient(policy_target, timeout=120, load_balancing="round_robin") as policy,
                ScoringClient(reference_target, timeout=120) as reference,
            ):
                start = time.monotonic()
                for replica in replica_targets(policy_target):  # every one, for the pushes
                    with ScoringClient(replica) as one:
                        one.wait_until_serving(timeout=300)
                reference.wait_until_serving(timeout=300)
                print(f"servers ready in {time.monotonic() - start:.1f} s", file=sys.stderr)
                run(args, policy, reference, trainer)
    return 0


if __name__ == "__main__":
    sys.exit(main())

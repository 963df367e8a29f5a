#!/usr/bin/env python
"""Score RL rollouts with a reference policy served by megascore and compute per-token KL.

A GRPO / PPO step needs, for every rollout (prompt + sampled response), the
reference policy's log-probabilities of the response tokens, to form the KL
penalty against the policy that sampled them. This example:

1. loads rollouts (``--rollouts FILE.jsonl`` with ``prompt_ids``, ``response_ids``
   and the sampler's ``response_logprobs``), or synthesises a batch;
2. scores ``prompt + response`` with the loss mask over the response tokens only,
   streaming microbatches over one ScoreStream as a rollout loop would;
3. reads ``logprobs[i][P:]``: with megascore's layout (entry t is
   ``log p(x_t | x_<t)``) position ``P + j`` is exactly the reference logprob of
   response token ``j``, aligned with the sampler's logprob of the same token;
4. computes the per-token KL estimators ``k1 = s - r`` and
   ``k3 = exp(r - s) - (r - s) - 1`` (``s``: sampler, ``r``: reference), masked
   means per rollout and for the batch.

Needs: pip install 'megascore' (the client SDK only; the server it talks to needs
``megascore[server]``). The commands below assume the virtual environment is active
(``source .venv/bin/activate``). Run a server first (``megascore serve --model tiny``),
then::

    python examples/rl_rollout_scoring.py --target 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from megascore_client import ScoringClient


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="127.0.0.1:50051", help="megascore server")
    parser.add_argument("--token", default=None, help="bearer token, if the server needs one")
    parser.add_argument("--rollouts", default=None, help="JSONL rollouts (default: synthetic)")
    parser.add_argument("--num-rollouts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--max-response-len", type=int, default=48)
    parser.add_argument("--microbatch", type=int, default=8, help="rollouts per stream request")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def synthetic_rollouts(args, vocab_size: int) -> list[dict]:
    """Random prompts and responses with made-up sampler logprobs (stand-in for vLLM)."""
    rng = np.random.default_rng(args.seed)
    rollouts = []
    for _ in range(args.num_rollouts):
        response_len = int(rng.integers(1, args.max_response_len + 1))
        rollouts.append(
            {
                "prompt_ids": rng.integers(0, vocab_size, args.prompt_len).tolist(),
                "response_ids": rng.integers(0, vocab_size, response_len).tolist(),
                # A near-uniform sampler: log(1/V) plus noise.
                "response_logprobs": (
                    -np.log(vocab_size) + rng.normal(0.0, 0.3, response_len)
                ).tolist(),
            }
        )
    return rollouts


def load_rollouts(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def build_batch(rollouts: list[dict]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Sequences ``prompt + response`` and loss masks that select the response tokens."""
    sequences, masks = [], []
    for r in rollouts:
        prompt, response = r["prompt_ids"], r["response_ids"]
        sequences.append(np.asarray(prompt + response, dtype=np.int64))
        masks.append(np.r_[np.zeros(len(prompt), np.uint8), np.ones(len(response), np.uint8)])
    return sequences, masks


def kl_per_token(sampler: np.ndarray, reference: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """k1 and k3 KL estimators of KL(sampler || reference), one value per response token."""
    log_ratio = reference - sampler
    return -log_ratio, np.expm1(log_ratio) - log_ratio


def main(argv=None) -> int:
    args = parse_args(argv)
    with ScoringClient(args.target, token=args.token) as client:
        info = client.model_info()
        print(f"model {info.name} ({info.architecture}), weights {info.weights_version}")
        rollouts = (
            load_rollouts(args.rollouts)
            if args.rollouts
            else synthetic_rollouts(args, info.vocab_size)
        )
        sequences, masks = build_batch(rollouts)
        start = time.perf_counter()
        with client.stream() as stream:
            futures = [
                stream.submit(
                    sequences[i : i + args.microbatch],
                    loss_mask=masks[i : i + args.microbatch],
                    request_id=f"rollouts-{i}",
                )
                for i in range(0, len(sequences), args.microbatch)
            ]
            results = [f.result() for f in futures]
        elapsed = time.perf_counter() - start
    reference = [lp for result in results for lp in result.logprobs]
    nll = np.concatenate([result.loss["nll"] for result in results])
    k1_all, k3_all = [], []
    print(f"{'rollout':>7} {'resp_len':>8} {'ref_nll/tok':>11} {'kl_k1':>9} {'kl_k3':>9}")
    for i, rollout in enumerate(rollouts):
        prompt_len = len(rollout["prompt_ids"])
        ref = reference[i][prompt_len:].astype(np.float64)  # log p_ref(response_j | ...)
        sampler = np.asarray(rollout["response_logprobs"], dtype=np.float64)
        k1, k3 = kl_per_token(sampler, ref)
        k1_all.append(k1)
        k3_all.append(k3)
        if i < 8:
            per_token_nll = nll[i] / len(ref)
            print(
                f"{i:>7} {len(ref):>8} {per_token_nll:>11.4f} {k1.mean():>9.4f} {k3.mean():>9.4f}"
            )
    k1_flat, k3_flat = np.concatenate(k1_all), np.concatenate(k3_all)
    tokens = sum(len(s) for s in sequences)
    print(f"rollouts: {len(rollouts)}, response tokens: {k1_flat.size}, requests: {len(results)}")
    print(f"mean KL per response token: k1 {k1_flat.mean():.5f}, k3 {k3_flat.mean():.5f}")
    print(f"reference NLL per response token: {nll.sum() / k1_flat.size:.5f}")
    print(f"scored {tokens} tokens in {elapsed * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

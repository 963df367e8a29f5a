"""Scores a sample batch against a running megascore server and prints the results.

Used by scripts/demo.sh; also a minimal example of the SDK:
    python scripts/demo_client.py --target 127.0.0.1:50051
"""

from __future__ import annotations

import argparse

import numpy as np

from megascore_client import ScoringClient


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--wait", type=float, default=300.0, help="seconds to wait for SERVING")
    args = parser.parse_args()

    with ScoringClient(args.target) as client:
        client.wait_until_serving(timeout=args.wait)
        info = client.model_info()
        print(
            f"model {info.name} ({info.architecture}): {info.num_parameters:,} parameters, "
            f"vocab {info.vocab_size}, dtype {info.dtype}, attention {info.attention_backend}, "
            f"weights {info.weights_version}"
        )
        rng = np.random.default_rng(0)
        sequences = [rng.integers(1, info.vocab_size, size=n).tolist() for n in (7, 1, 12, 4)]
        result = client.score(sequences, top_k=3, losses=("nll", "mean_nll"))

    np.set_printoptions(precision=4, suppress=True, linewidth=120)
    for i, seq in enumerate(sequences):
        print(f"\nsequence {i}: {len(seq)} tokens")
        print(f"  token ids      {seq}")
        print(f"  logprobs       {result.logprobs[i]}")
        print(f"  top-3 ids @t=1 {result.top_k_ids[i][1] if len(seq) > 1 else '-'}")
        print(
            f"  nll {result.loss['nll'][i]:.4f} over {result.num_tokens[i]} tokens, "
            f"mean_nll {result.loss['mean_nll'][i]:.4f}"
        )
    t = result.timings
    print(
        f"\nserver: queue {t.queue_ms:.1f} ms, compute {t.compute_ms:.1f} ms, "
        f"total {t.total_ms:.1f} ms in {t.num_steps} step(s); weights {result.weights_version}"
    )
    if result.moe_metrics or result.mtp_metrics:
        print(f"moe metrics {result.moe_metrics}\nmtp metrics {result.mtp_metrics}")


if __name__ == "__main__":
    main()

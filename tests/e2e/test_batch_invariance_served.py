"""Issue 24, served: through ``megascore serve`` and the SDK a sequence's outputs are the
same bits whether it is sent alone, inside a batch the SDK splits into many requests, or
by one of 4 clients sending at once (the dynamic batcher then packs their requests into
shared steps in whatever order they arrive). The engine-side packings and microbatch
splits are ``tests/distributed/test_batch_invariance.py``.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from megascore_client import ScoringClient

NUM_SEQUENCES = 200
CLIENTS = 4
KW = dict(top_k=5, losses=("nll", "mean_nll", "perplexity"))


def _per_sequence(result) -> list[dict[str, np.ndarray]]:
    out = []
    for i in range(len(result)):
        entry = {
            "logprobs": result.logprobs[i],
            "top_k_ids": result.top_k_ids[i],
            "top_k_logprobs": result.top_k_logprobs[i],
            "num_tokens": result.num_tokens[i],
        }
        entry.update({name: values[i] for name, values in result.loss.items()})
        out.append(entry)
    return out


def _assert_identical(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), where
    for name, value in want.items():
        assert np.array_equal(got[name], value), f"{where}: {name} differs"


@pytest.mark.timeout(600)
def test_alone_split_and_concurrent_clients_give_the_same_bits(tp1):
    rng = np.random.default_rng(2024)
    with ScoringClient(tp1.target, timeout=300) as client:
        info = client.model_info()
        lengths = rng.integers(1, min(512, info.max_sequence_length) + 1, size=NUM_SEQUENCES)
        seqs = [rng.integers(0, info.vocab_size, size=n).tolist() for n in lengths]
        alone = [_per_sequence(client.score([s], **KW))[0] for s in seqs]

    with ScoringClient(tp1.target, timeout=300, max_request_tokens=3000) as client:
        result = client.score(seqs, **KW)
        assert result.timings.num_requests > 10  # the SDK did split the batch
        for i, got in enumerate(_per_sequence(result)):
            _assert_identical(got, alone[i], f"split batch, sequence {i}")

    def one_client(seed: int) -> list[tuple[int, dict]]:
        order = np.random.default_rng(seed).permutation(NUM_SEQUENCES)
        scored = []
        with ScoringClient(tp1.target, timeout=300) as client:
            for chunk in np.array_split(order, 25):
                result = client.score([seqs[i] for i in chunk], **KW)
                scored += list(zip(chunk.tolist(), _per_sequence(result), strict=True))
        return scored

    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        runs = list(pool.map(one_client, range(CLIENTS)))
    for c, scored in enumerate(runs):
        for i, got in scored:
            _assert_identical(got, alone[i], f"client {c}, sequence {i}")

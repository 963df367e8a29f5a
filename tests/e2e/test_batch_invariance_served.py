"""Issue 24, served: through ``megascore serve`` and the SDK a sequence's outputs are the
same bits whether it is sent alone, inside a batch the SDK splits into many requests, or
by one of 4 clients sending at once (the dynamic batcher then packs their requests into
shared steps in whatever order they arrive), on ``tiny`` and ``tiny-moe`` (with routing):
the session's shared servers. Every output the SDK returns is compared with ``==``:
logprobs, top-k, losses, loss-token counts, entropy, target-id logprobs, mismatch
statistics, importance weights, token ranks, the next token and routing, at temperature
0.7; each sequence carries its own target ids and rollout logprobs. The engine-side
packings and microbatch splits, and the Qwen3-MoE ``hf:DIR`` checkpoint (the serving
path is the same for every model), are ``tests/distributed/test_batch_invariance.py``.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from megascore_client import ScoringClient
from tests.e2e.server_pool import module_pool

NUM_SEQUENCES = 200
CLIENTS = 4
NUM_TARGETS = 3
KW = dict(
    top_k=5,
    temperature=0.7,
    losses=("nll", "mean_nll", "perplexity"),
    return_entropy=True,
    return_importance_weights=True,
    return_token_ranks=True,
    return_next_token=True,
)
PER_TOKEN = ("logprobs", "top_k_ids", "top_k_logprobs", "entropy", "target_logprobs")
PER_TOKEN += ("importance_weights", "routing", "token_ranks")
PER_SEQUENCE = ("next_token_ids", "next_token_logprobs")
SHARED_SERVERS = {"tiny": "tp1", "tiny-moe": "moe1"}
"""The session's shared one-rank servers (their other tests' calls before these do not
change a sequence's bits either)."""
CONFIGS = tuple(SHARED_SERVERS)
pytestmark = pytest.mark.usefixtures(*(f"shared_{name}" for name in SHARED_SERVERS.values()))


@pytest.fixture(scope="module")
def pool(request, tmp_path_factory):
    yield from module_pool(request, tmp_path_factory, "serve-invariance", {}, SHARED_SERVERS)


@pytest.fixture
def server(pool, config):
    yield from pool.lend(config)


def _per_sequence(result) -> list[dict[str, np.ndarray]]:
    """Every output of the result, per sequence, by name."""
    out = []
    for i in range(len(result)):
        entry = {"num_tokens": result.num_tokens[i]}
        entry.update({n: getattr(result, n)[i] for n in PER_TOKEN if getattr(result, n)})
        entry.update({n: getattr(result, n)[i] for n in PER_SEQUENCE})
        entry.update({f"loss.{n}": values[i] for n, values in result.loss.items()})
        entry.update({f"mismatch.{n}": v[i] for n, v in result.mismatch_stats.items()})
        out.append(entry)
    return out


def _assert_identical(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), where
    for name, value in want.items():
        assert np.array_equal(got[name], value), f"{where}: {name} differs"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("config", CONFIGS)
def test_alone_split_and_concurrent_clients_give_the_same_bits(server, config):
    rng = np.random.default_rng(2024)
    with ScoringClient(server.target, timeout=300) as client:
        info = client.model_info()
        lengths = rng.integers(1, min(512, info.max_sequence_length) + 1, size=NUM_SEQUENCES)
        seqs = [rng.integers(0, info.vocab_size, size=n).tolist() for n in lengths]
        targets = [rng.integers(0, info.vocab_size, (n, NUM_TARGETS)) for n in lengths]
        rollouts = [-rng.exponential(6.0, size=n) for n in lengths]
        routing = config != "tiny"
        kw = dict(KW, return_routing=routing)

        def score(c: ScoringClient, chosen):
            chosen = list(chosen)
            return c.score(
                [seqs[i] for i in chosen],
                target_ids=[targets[i] for i in chosen],
                rollout_logprobs=[rollouts[i] for i in chosen],
                **kw,
            )

        alone = [_per_sequence(score(client, [i]))[0] for i in range(NUM_SEQUENCES)]
    expected = {"entropy", "target_logprobs", "importance_weights", "mismatch.max_abs_diff"}
    expected |= {"token_ranks", "next_token_ids", "next_token_logprobs"}
    assert expected | ({"routing"} if routing else set()) <= alone[0].keys()

    with ScoringClient(server.target, timeout=300, max_request_tokens=3000) as client:
        result = score(client, range(NUM_SEQUENCES))
        assert result.timings.num_requests > 10  # the SDK did split the batch
        for i, got in enumerate(_per_sequence(result)):
            _assert_identical(got, alone[i], f"{config}: split batch, sequence {i}")

    def one_client(seed: int) -> list[tuple[int, dict]]:
        order = np.random.default_rng(seed).permutation(NUM_SEQUENCES)
        scored = []
        with ScoringClient(server.target, timeout=300) as client:
            for chunk in np.array_split(order, 25):
                got = _per_sequence(score(client, chunk.tolist()))
                scored += list(zip(chunk.tolist(), got, strict=True))
        return scored

    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as workers:
        runs = list(workers.map(one_client, range(CLIENTS)))
    for c, scored in enumerate(runs):
        for i, got in scored:
            _assert_identical(got, alone[i], f"{config}: client {c}, sequence {i}")

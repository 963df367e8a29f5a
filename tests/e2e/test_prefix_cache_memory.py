"""The prefix cache's memory from outside: ``megascore serve --model tiny --prefix-cache-gib
1/64`` (16 MiB) given 10x its budget in distinct prefixes, through the SDK.

Rounds of distinct 1,024-token sequences (each round 1x the budget in keys and values),
with a request reusing one hot prefix between them: every request is answered, the hot
prefix is read from the cache after every round (its history survives the flood: the
segmented LRU), the cache's stored bytes (Prometheus) stay within the budget, it evicted,
and the server's resident memory grows by at most the budget plus a fixed margin over the
whole run (measured after the first round, when the request shapes have warmed the
allocator, against the end and every round between).
"""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from megascore_client import ScoringClient
from tests.e2e.serve import own_servers

BUDGET_GIB = 1 / 64
BUDGET = int(BUDGET_GIB * 2**30)
MARGIN = 48 * 2**20
"""RSS beyond the budget the run may add: allocator arenas and a request's own tensors
(a leak of the flood's keys and values alone would be 9x the budget)."""
LENGTH, PER_REQUEST = 1024, 4
HOT = 512


def _metric(server, name: str) -> float:
    for family in text_string_to_metric_families(server.metrics_text()):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not exported")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    gen = own_servers(tmp_path_factory.mktemp("prefix_cache_memory"))
    start = next(gen)
    server = start("--model", "tiny", "--prefix-cache-gib", str(BUDGET_GIB), metrics=True)
    server.wait_serving()
    yield server
    gen.close()


def test_ten_budgets_of_distinct_prefixes_keep_rss_and_the_hot_prefix(server):
    rng = np.random.default_rng(7)
    with ScoringClient(server.target, timeout=120) as client:
        vocab = client.model_info().vocab_size
        hot = rng.integers(0, vocab, HOT).tolist()

        def flood_request() -> int:
            seqs = [rng.integers(0, vocab, LENGTH).tolist() for _ in range(PER_REQUEST)]
            return len(client.score(seqs, losses=("nll",)))

        flood_request()  # the warm-up: the request shapes, a quarter of the budget
        per_token = _metric(server, "megascore_prefix_cache_stored_bytes") / (LENGTH * PER_REQUEST)
        per_round = -(-BUDGET // int(per_token * LENGTH * PER_REQUEST))  # 1x the budget
        for _ in range(2):  # written, then read: a hot prefix (the cache's protected part)
            client.score([hot + rng.integers(0, vocab, 40).tolist()], score_from=[HOT])
        rss, answered, rounds = [server.total_rss_kb() * 1024], 0, 10
        for r in range(rounds):
            answered += sum(flood_request() for _ in range(per_round))
            res = client.score([hot + rng.integers(0, vocab, 40).tolist()], score_from=[HOT])
            # after a whole budget of new prefixes; its last block predicts a new token
            # (a block's last entry is kept per next token): read up to that block
            assert int(res.cached_tokens[0]) >= HOT - 64, (r, res.cached_tokens)
            stored = _metric(server, "megascore_prefix_cache_stored_bytes")
            assert stored <= BUDGET, (r, stored)
            rss.append(server.total_rss_kb() * 1024)
        assert answered == rounds * per_round * PER_REQUEST
        assert _metric(server, "megascore_prefix_cache_evictions_total") > 0
        growth = max(rss) - rss[0]
        assert growth <= BUDGET + MARGIN, (
            f"RSS grew {growth / 2**20:.1f} MiB over a {BUDGET / 2**20:.0f} MiB budget "
            f"(per round, MiB: {[round(x / 2**20) for x in rss]})"
        )

"""The prefix cache from outside: ``megascore serve`` (its default: the cache on) against
``megascore serve --no-prefix-cache``, both on ``tiny`` (CPU) with the HTTP front.

* a trajectory scored turn by turn through the SDK (each turn the whole history, outputs
  from the new turn on for some turns): every output equal bit for bit, ``cached_tokens``
  > 0 from the second turn on (0 without the cache), and the server's Prometheus
  ``megascore_prefix_cache_hit_tokens_total`` grew by what the answers reported;
* a partial weight push to both servers between two turns, then a delta push (its full
  base) and a delta patch: each next turn equals the server without a cache (a stale
  cached key or value would not) and reads nothing cached; a request pinned to the old
  version is refused;
* ``/v1/completions`` (token-id prompts, ``echo``, ``logprobs``): the same prompt twice,
  the second answer ``usage.prompt_tokens_details.cached_tokens`` > 0 and its logprobs
  equal to the first's.
"""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from megascore_client import ScoringClient
from megascore_server.ports import pick_port
from testkit.reference import VOCAB
from tests.e2e.serve import own_servers

NORM = "decoder.final_layernorm.weight"
HIDDEN = 64
OPTIONS = dict(top_k=3, losses=("nll",), return_entropy=True)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """``(cached, uncached)``: own servers (the test pushes weights to them)."""
    gen = own_servers(tmp_path_factory.mktemp("prefix_cache"))
    start = next(gen)
    pair = []
    for extra in ((), ("--no-prefix-cache",)):
        http_port = pick_port()
        server = start("--model", "tiny", "--grace-s", "5", "--http-port", str(http_port),
                       *extra, metrics=True)  # fmt: skip
        server.http_port = http_port
        pair.append(server)
    for server in pair:
        server.wait_serving()
    yield pair
    gen.close()


def _hits(server) -> float:
    for family in text_string_to_metric_families(server.metrics_text()):
        for sample in family.samples:
            if sample.name == "megascore_prefix_cache_hit_tokens_total":
                return sample.value
    return 0.0


def _turns(seed: int, count: int):
    rng = np.random.default_rng(seed)
    history = rng.integers(0, VOCAB, 150).tolist()
    for _ in range(count):
        start = len(history)
        history = history + rng.integers(0, VOCAB, int(rng.integers(30, 80))).tolist()
        yield list(history), start


def _score_both(servers, seqs, **kw):
    out = []
    for server in servers:
        with ScoringClient(server.target, timeout=120) as client:
            out.append(client.score(seqs, **OPTIONS, **kw))
    return out


def _assert_same(a, b):
    for name in ("logprobs", "top_k_ids", "top_k_logprobs", "entropy"):
        for x, y in zip(getattr(a, name), getattr(b, name), strict=True):
            np.testing.assert_array_equal(x, y)
    assert a.loss == b.loss


def test_turn_by_turn_equals_no_cache_and_reads_the_history(servers):
    cached, uncached = servers
    before = _hits(cached)
    reported = 0
    for turn, (history, start) in enumerate(_turns(seed=1, count=4)):
        score_from = [start] if turn % 2 else None
        got, want = _score_both(servers, [history], score_from=score_from)
        _assert_same(got, want)
        assert int(want.cached_tokens[0]) == 0
        if turn:
            assert int(got.cached_tokens[0]) >= 128, (turn, got.cached_tokens)
        reported += int(got.cached_tokens[0])
    assert _hits(cached) - before == reported > 0
    assert _hits(uncached) == 0  # a call's own sharing only: nothing across calls here


def test_a_push_between_turns_leaves_nothing_stale(servers):
    turns = list(_turns(seed=2, count=3))
    first = _score_both(servers, [turns[0][0]])[0]
    for server in servers:
        with ScoringClient(server.target, timeout=120) as client:
            norm = np.full(HIDDEN, 1.25, dtype=np.float32)
            client.push_weights(
                [(NORM, norm)], names="megatron", partial=True, weights_version="p1"
            )
    got, want = _score_both(servers, [turns[1][0]])
    _assert_same(got, want)
    assert got.weights_version == want.weights_version == "p1"
    assert int(got.cached_tokens[0]) == 0  # turn 1's history was cached on the old weights
    assert not np.array_equal(got.logprobs[0][:10], first.logprobs[0][:10])
    with ScoringClient(servers[0].target, timeout=120) as client:
        with pytest.raises(Exception) as refused:
            client.score([turns[2][0]], weights_version=first.weights_version)
    assert "version" in str(refused.value).lower()
    got, want = _score_both(servers, [turns[2][0]])  # cached again, on the new weights
    _assert_same(got, want)
    assert int(got.cached_tokens[0]) > 0
    norm = np.full(HIDDEN, 1.25, dtype=np.float32)
    for version, changed in (("d1", 0.5), ("d2", 0.75)):  # a full delta base, then a patch
        norm[3] = changed
        for server in servers:
            with ScoringClient(server.target, timeout=120) as client:
                client.push_weights([(NORM, norm)], names="megatron", partial=True,
                                    weights_version=version, delta=True)  # fmt: skip
        got, want = _score_both(servers, [turns[2][0]])
        _assert_same(got, want)
        assert got.weights_version == version and int(got.cached_tokens[0]) == 0


def _completions(server, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": [prompt], "echo": True, "logprobs": 1, "max_tokens": 0}
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_completions_report_cached_prompt_tokens(servers):
    cached = servers[0]
    prompt = np.random.default_rng(3).integers(0, VOCAB, 300).tolist()
    first, second = _completions(cached, prompt), _completions(cached, prompt)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
    lp = [c["logprobs"]["token_logprobs"] for c in (first["choices"][0], second["choices"][0])]
    assert lp[0] == lp[1]

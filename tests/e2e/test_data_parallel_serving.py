"""EP ranks share a step, through ``megascore serve --model tiny-moe --nproc 2 --ep 2``.

The two ranks are data-parallel: each scores its part of every step and rank 0 joins
them (``megascore.engine.schedule.data_parallel``). Against a ``--nproc 1`` server on the same
built-in weights, through the SDK (<= 1e-5):

* logprobs, top-k, NLL and the MoE / MTP metrics of one request;
* one sequence alone (the other rank scores padding only, for the expert collectives);
* routing: recorded on the EP server equals the one-rank server's; a shifted routing
  replayed on both gives the same logprobs on both, and not the routed ones.
"""

from __future__ import annotations

import numpy as np
import pytest

from megascore_client import ScoringClient

pytestmark = pytest.mark.timeout(900)
ATOL = 1e-5
VOCAB = 512
EXPERTS = 4
LAYOUTS = {"one": ("--nproc", "1"), "ep2": ("--nproc", "2", "--ep", "2")}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from tests.e2e.serve import ServeProcess

    started = {}
    try:
        for name, flags in LAYOUTS.items():
            log = tmp_path_factory.mktemp(name) / "serve.log"
            started[name] = ServeProcess(log, "--model", "tiny-moe", *flags)
        for server in started.values():
            server.wait_serving()
        yield started
    finally:
        for server in started.values():
            server.close()


def _sequences(seed: int, num: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(n)) for n in rng.integers(2, 60, num)]


def _score(servers, seqs, **kwargs) -> dict:
    out = {}
    for name, server in servers.items():
        with ScoringClient(server.target, timeout=120) as client:
            out[name] = client.score(seqs, **kwargs)
    return out


def _assert_close(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=ATOL)


@pytest.mark.parametrize("num", [9, 1])
def test_ep2_equals_one_rank(servers, num):
    seqs = _sequences(num, num)
    res = _score(servers, seqs, top_k=3, losses=("nll",), metrics=("moe", "mtp"))
    one, ep2 = res["one"], res["ep2"]
    _assert_close(one.logprobs, ep2.logprobs)
    _assert_close(one.top_k_logprobs, ep2.top_k_logprobs)
    assert all(np.array_equal(a, b) for a, b in zip(one.top_k_ids, ep2.top_k_ids, strict=True))
    np.testing.assert_allclose(one.loss["nll"], ep2.loss["nll"], rtol=0, atol=1e-4)
    for kind in ("moe_metrics", "mtp_metrics"):
        want, got = getattr(one, kind), getattr(ep2, kind)
        assert want and want.keys() == got.keys()
        for name, value in want.items():
            assert got[name] == pytest.approx(value, abs=ATOL), (kind, name)


def test_ep2_records_and_replays_routing(servers):
    seqs = _sequences(3, 7)
    recorded = _score(servers, seqs, return_routing=True)
    for a, b in zip(recorded["one"].routing, recorded["ep2"].routing, strict=True):
        np.testing.assert_array_equal(a, b)
    shifted = [(r + 1) % EXPERTS for r in recorded["one"].routing]  # top-2 stay distinct
    replayed = _score(servers, seqs, routing=shifted, return_routing=True)
    _assert_close(replayed["one"].logprobs, replayed["ep2"].logprobs)
    for r in replayed.values():
        assert all(np.array_equal(a, b) for a, b in zip(r.routing, shifted, strict=True))
    diff = max(
        float(np.abs(a - b).max())
        for a, b in zip(replayed["ep2"].logprobs, recorded["ep2"].logprobs, strict=True)
    )
    assert diff > 1e-3

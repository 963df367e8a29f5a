"""The prefix cache on one rank: every answer equals a cache-off engine's, bit for bit.

The cache-off engine keeps nothing between calls and shares nothing within one
(``prefix_cache=False, prefix_sharing=False``: every sequence computed whole); the
cache-on engine reads earlier requests' prefixes and computes a call's shared prefixes
once. Both run the key-block attention (batch-invariant CPU defaults). The workload is
:func:`tests.prefix_cache_cases.cache_workload`; TP2 / EP2 / PP2 are in
tests/distributed/test_prefix_cache.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megascore.api.types import ScoreBatch
from megascore.config import EngineConfig
from megascore.engine.runtime import DistributedEngine
from tests.one_rank import one_rank_world
from tests.prefix_cache_cases import (
    BLOCK,
    assert_same_outputs,
    cache_workload,
    host_tier_workload,
)

OFF = dict(prefix_cache=False, prefix_sharing=False)


def _answers(model: str, requests, **cfg):
    """Each request's output from a fresh one-rank engine, and the engine's cache stats."""
    engine = DistributedEngine.create(
        EngineConfig(model=model, attention_block=BLOCK, min_shared_prefix=8, **cfg)
    )
    try:
        return [engine.score(r) for r in requests], engine.prefix_cache_stats()
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def tiny():
    requests = cache_workload(seed=1)
    with one_rank_world():
        return requests, _answers("tiny", requests, **OFF), _answers("tiny", requests)


def test_every_answer_equals_the_cache_off_engine(tiny):
    requests, (off, _), (on, stats) = tiny
    for i, (got, want) in enumerate(zip(on, off, strict=True)):
        assert_same_outputs(got, want, f"request {i}")
    assert stats["hit_tokens"] > 0


def test_cached_tokens_count_whole_blocks_of_earlier_requests(tiny):
    requests, (off, _), (on, _) = tiny
    hits = [int(o.values["cached_tokens"].sum()) for o in on]
    assert all(int(o.values["cached_tokens"].sum()) == 0 for o in off)
    assert hits[0] == 0  # nothing before the first request
    assert all(h % BLOCK == 0 for h in hits)
    # the third trajectory's first turn finds the system prompt the first one left (it
    # asks for outputs from its own turn on); the second asks for every output, at
    # another temperature, which the first one's blocks do not hold
    assert hits[2] >= 2 * BLOCK and hits[1] == 0
    # a later turn of a trajectory reads at least what the turn before it held
    for t in range(3):
        turns = [hits[4 * k + t] for k in range(4)]
        assert turns[1:] == sorted(turns[1:]) and turns[-1] > turns[0], (t, turns)
    # every sequence leaves its last row to compute
    for request, out in zip(requests, on, strict=True):
        assert (out.values["cached_tokens"] < request.lengths).all()


def test_the_group_in_one_request_shares_its_prompt(tiny):
    requests, _, (on, _) = tiny
    group, again, twice = [i for i, r in enumerate(requests) if r.num_sequences == 4]
    assert (on[twice].values["cached_tokens"] > on[again].values["cached_tokens"]).all()
    # its prompt's blocks were cached by the four requests of one response before it
    assert (on[group].values["cached_tokens"] == 3 * BLOCK).all()


def test_a_host_tier_keeps_what_a_small_device_tier_evicts_and_answers_the_same():
    """A device tier of about 8 blocks with a host tier behind it, and trajectories whose
    next turn comes after other requests' prefixes filled the device tier: blocks move
    out and back (the ranks make the moves before their forward), every answer is the
    cache-off engine's, and more is read than by the same device tier alone."""
    requests = host_tier_workload()
    device = dict(prefix_cache_gib=8 * 2**13 / 2**30)  # 8 slots of tiny's 8 KiB at 16
    with one_rank_world():
        off, _ = _answers("tiny", requests, **OFF)
        on, stats = _answers("tiny", requests, **device, prefix_cache_host_gib=2**20 / 2**30)
        _, alone = _answers("tiny", requests, **device)
    for i, (got, want) in enumerate(zip(on, off, strict=True)):
        assert_same_outputs(got, want, f"request {i}")
    assert stats["demotions"] > 0 and stats["promotions"] > 0, stats
    assert stats["stored_bytes"] <= 8 * 2**13 and stats["host_bytes"] > 0, stats
    assert alone["evictions"] > 0 and alone["promotions"] == 0, alone
    # every turn after the first reads its trajectory's history back from the host tier
    hits = [int(o.values["cached_tokens"][0]) for o in on]
    assert all(h >= 5 * BLOCK for h in hits[3:]), hits
    assert stats["hit_tokens"] > alone["hit_tokens"], (stats, alone)


def test_a_group_new_to_the_cache_is_shared_within_its_step():
    requests = cache_workload(seed=2)
    group = next(r for r in requests if r.num_sequences == 4)
    with one_rank_world():
        (want,), _ = _answers("tiny", [group], **OFF)
        (got,), stats = _answers("tiny", [group], prefix_cache=False)
    assert_same_outputs(got, want)
    assert (got.values["cached_tokens"] == 3 * BLOCK).all()  # computed once, then read
    assert stats["blocks"] == 0  # prefix_cache=False: nothing kept after the call


def test_moe_routes_recorded_and_replayed_and_metrics_equal_the_cache_off_engine():
    requests = cache_workload(seed=3, return_routing=True)[:8]
    with one_rank_world():
        off, _ = _answers("tiny-moe", requests, **OFF)
        replays = [
            dataclasses.replace(r, routing=o.values["routing"])
            for r, o in zip(requests, off, strict=True)
        ]
        metrics = [dataclasses.replace(r, return_routing=False, return_moe_metrics=True,
                                       return_mtp_metrics=True) for r in requests]  # fmt: skip
        off_more, _ = _answers("tiny-moe", replays + metrics, **OFF)
        plain = [dataclasses.replace(r, return_routing=False) for r in requests]
        on, stats = _answers("tiny-moe", plain + requests + replays + metrics)
    n = len(requests)
    for i in range(n):
        assert_same_outputs(on[n + i], off[i], f"recorded {i}")
        assert_same_outputs(on[2 * n + i], off_more[i], f"replayed {i}")
        assert_same_outputs(on[3 * n + i], off_more[n + i], f"metrics {i}")
        assert on[3 * n + i].moe_metrics == off_more[n + i].moe_metrics
        assert on[3 * n + i].mtp_metrics == off_more[n + i].mtp_metrics
        # routing and metrics steps neither read nor write the cache (module docstring)
        assert int(on[n + i].values["cached_tokens"].sum()) == 0
    assert stats["hit_tokens"] > 0  # the plain requests did read it


def test_new_weights_empty_the_cache(tmp_path):
    """After a LoadWeights the next turns equal a fresh engine on the new weights, and a
    turn whose history was cached before finds nothing."""
    from testkit.checkpoints import VOCAB as HF_VOCAB
    from testkit.checkpoints import write_hf_checkpoint

    requests = [
        dataclasses.replace(r, token_ids=r.token_ids % HF_VOCAB, target_ids=r.target_ids % HF_VOCAB)
        for r in cache_workload(seed=4)[:8]
    ]
    for name, seed in (("a", 0), ("b", 1)):
        write_hf_checkpoint("llama", tmp_path / name, seed=seed)
    with one_rank_world():
        engine = DistributedEngine.create(
            EngineConfig(model=f"hf:{tmp_path / 'a'}", attention_block=BLOCK)
        )
        try:
            before = [engine.score(r) for r in requests[:4]]
            engine.load_weights(f"hf:{tmp_path / 'b'}", "b")
            after = [engine.score(r) for r in requests[4:]]
        finally:
            engine.shutdown()
        fresh, _ = _answers(f"hf:{tmp_path / 'b'}", requests[4:], **OFF)
    for got, want in zip(after, fresh, strict=True):
        assert_same_outputs(got, want)
    assert int(before[2].values["cached_tokens"].sum()) > 0  # the system prompt, before
    assert int(after[0].values["cached_tokens"].sum()) == 0  # turn 2 of trajectory 0


def test_the_batcher_costs_a_request_by_its_uncached_tails():
    """``Sharing.of(engine).units``: a request's units cost what the cache does not hold
    (the engine's own estimate), and a step of the batcher sees the smaller cost."""
    from megascore_server.shared_units import Sharing

    rng = np.random.default_rng(7)
    history = rng.integers(1, 500, 5 * BLOCK + 3)
    longer = ScoreBatch(np.r_[history, rng.integers(1, 500, 20)], np.array([len(history) + 20]))
    with one_rank_world():
        engine = DistributedEngine.create(EngineConfig(model="tiny", attention_block=BLOCK))
        try:
            sharing = Sharing.of(engine)
            _, before = sharing.units(longer, 1, 10_000)
            engine.score(ScoreBatch(history, np.array([len(history)])))
            cached = engine.cached_prefix_tokens(longer)
            _, after = sharing.units(longer, 1, 10_000)
            got = engine.score(longer).cached_tokens
        finally:
            engine.shutdown()
    assert cached.tolist() == [5 * BLOCK] == got.tolist()
    assert before.tolist() == [longer.num_tokens] and after.tolist() == [
        longer.num_tokens - 5 * BLOCK
    ]


def test_multi_latent_attention_equals_the_cache_off_engine(tmp_path):
    """A DeepSeek-V3-shaped ``hf:`` checkpoint (MLA with a query LoRA and YaRN, MoE, an MTP
    layer): its cached keys and values are MLA's expanded ones, and every answer is the
    cache-off engine's bit for bit."""
    from testkit.checkpoints import VOCAB as HF_VOCAB
    from tests.unit.test_prefix_sharing_mla import write_mla_checkpoint

    write_mla_checkpoint("deepseek_v3", tmp_path)
    requests = [
        dataclasses.replace(r, token_ids=r.token_ids % HF_VOCAB, target_ids=r.target_ids % HF_VOCAB)
        for r in cache_workload(seed=5)
    ]
    with one_rank_world():
        off, _ = _answers(f"hf:{tmp_path}", requests, **OFF)
        on, stats = _answers(f"hf:{tmp_path}", requests)
    for i, (got, want) in enumerate(zip(on, off, strict=True)):
        assert_same_outputs(got, want, f"request {i}")
    assert stats["hit_tokens"] > 0


def test_weight_sets_keep_their_own_prefixes_and_answer_as_alone():
    """Two weight sets on one engine, the same turn-by-turn histories scored under each in
    turn: a set never reads the other's blocks (the first scoring under the second set
    reads nothing), each reads its own, and every answer is bit for bit that of a
    cache-off engine on that set's weights."""
    requests = host_tier_workload(seed=7)[:6]
    sets = ("one=builtin:tiny@1", "two=builtin:tiny@2")
    with one_rank_world():
        alone = {
            name: _answers(model, requests, **OFF)[0]
            for name, model in (s.split("=") for s in sets)
        }
        both = [dataclasses.replace(r, model=name) for r in requests for name in alone]
        on, stats = _answers("tiny", both, weights=sets)
    for i, out in enumerate(on):
        name = both[i].model
        assert_same_outputs(out, alone[name][i // 2], f"request {i // 2} under {name}")
    hits = [int(o.values["cached_tokens"][0]) for o in on]
    assert hits[0] == hits[1] == 0, hits  # the same tokens: no hit across the sets
    assert all(h >= 5 * BLOCK for h in hits[6:]), hits  # each set's own second turn
    assert stats["hit_tokens"] == sum(hits)


def test_an_adapters_sequences_are_keyed_by_the_adapter_and_its_version():
    """``WeightSets.cache_seeds``: per sequence, the set and the sequence's adapter (by its
    slot) with their versions and changes: the base and each adapter seed their keys
    apart, and a pushed adapter (a new version, or the same label again) never reads its
    old blocks."""
    from types import SimpleNamespace

    from megascore.api.served_models import ServedModel
    from megascore.engine.weights.sets import WeightSets

    def seeds(version_a: str, slots) -> list[bytes]:
        sets = SimpleNamespace(
            records={"base": SimpleNamespace(weights_version="v0")},
            adapters={
                "a": ServedModel("a", version_a, "base", 0),
                "b": ServedModel("b", "b-1", "base", 1),
            },
            _changes=changes,
        )
        batch = ScoreBatch(np.arange(6), np.full(3, 2), adapter=np.asarray(slots, np.int64))
        return WeightSets.cache_seeds(sets, batch, "base")

    changes: dict[str, int] = {}
    base, a, b = seeds("a-1", [-1, 0, 1])
    assert len({base, a, b}) == 3
    assert seeds("a-2", [-1, 0, 1]) == [base, seeds("a-2", [0, 0, 0])[0], b]
    assert seeds("a-2", [0, 0, 0])[0] != a  # the pushed version
    WeightSets.changed(SimpleNamespace(_changes=changes), "a")  # pushed again, same label
    assert seeds("a-1", [-1, 0, 1]) == [base, seeds("a-1", [0])[0], b] != [base, a, b]

"""Prefix affinity (``load_balancing="prefix"``, megascore_client.routing): the hash, the
spread, the moves when replicas come and go, and real calls over several in-process fake
replicas: one prefix on one replica, overload and failure sending calls elsewhere, split
batches routed part by part, the sync and asyncio clients alike."""

from __future__ import annotations

import asyncio
import collections

import grpc
import numpy as np
import pytest

from megascore_client import AsyncScoringClient, ScoringClient, ScoringError
from megascore_client.routing import (
    DOWN_S,
    PREFIX_KEY_HEADER,
    PREFIX_KEY_TOKENS,
    SPILL_MARGIN,
    ReplicaRouter,
    prefix_key,
    rendezvous_order,
)
from tests.client.fake_server import FakeScorer, FakeServer, ref_logprobs

RNG = np.random.default_rng(44)


def key_of(seq, tokens: int = PREFIX_KEY_TOKENS) -> str:
    return prefix_key(np.asarray(seq), [len(seq)], tokens)


def random_seq(length: int) -> list[int]:
    return RNG.integers(0, 500, size=length).tolist()


def test_key_is_the_first_tokens_of_the_first_sequence():
    head = random_seq(PREFIX_KEY_TOKENS)
    one, two = head + random_seq(40), head + random_seq(300)
    assert key_of(one) == key_of(two)  # share the first N tokens
    other = head.copy()
    other[-1] = (other[-1] + 1) % 500
    assert key_of(other + random_seq(40)) != key_of(one)  # differ inside them
    short = random_seq(100)  # shorter than N: all of it
    assert key_of(short) != key_of(short + [7])
    assert key_of(short, tokens=100) == key_of(short + [7], tokens=100)
    # the key does not depend on the id dtype, only on the values
    assert prefix_key(np.asarray(one, np.int32), [len(one)]) == key_of(one)
    assert len(key_of(one)) == 16 and int(key_of(one), 16) >= 0


def test_rendezvous_spreads_keys_evenly():
    replicas = [f"10.0.0.{i}:50051" for i in range(4)]
    keys = [key_of(random_seq(300)) for _ in range(200)]
    shares = collections.Counter(rendezvous_order(k, replicas)[0] for k in keys)
    # 200 keys over 4 replicas: 50 each expected, binomial sd ~6.1; 25..75 is > 4 sd
    assert sorted(shares) == [0, 1, 2, 3]
    assert all(25 <= n <= 75 for n in shares.values()), shares


def test_removing_a_replica_moves_only_its_keys_and_adding_one_takes_only_its_share():
    replicas = [f"10.0.0.{i}:50051" for i in range(5)]
    keys = [key_of(random_seq(300)) for _ in range(400)]
    before = {k: replicas[rendezvous_order(k, replicas)[0]] for k in keys}
    fewer = [r for r in replicas if r != replicas[2]]
    after = {k: fewer[rendezvous_order(k, fewer)[0]] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == replicas[2] for k in moved)  # only the removed one's
    assert len(moved) == sum(1 for k in keys if before[k] == replicas[2])
    # ... and they go to their second choice, spread over the others
    assert len({after[k] for k in moved}) > 1
    more = [*replicas, "10.0.0.9:50051"]
    grown = {k: more[rendezvous_order(k, more)[0]] for k in keys}
    gained = [k for k in keys if grown[k] != before[k]]
    assert gained and all(grown[k] == "10.0.0.9:50051" for k in gained)
    assert 400 / 6 / 2 < len(gained) < 400 / 6 * 2  # about 1/6 of the keys


def test_router_spills_to_the_next_in_order_when_overloaded_and_skips_a_down_replica():
    clock = [0.0]
    router = ReplicaRouter(["a:1", "b:1", "c:1"], clock=lambda: clock[0])
    key = key_of(random_seq(300))
    order = rendezvous_order(key, router.replicas)
    picks = [router.pick(key) for _ in range(SPILL_MARGIN)]
    assert picks == [order[0]] * SPILL_MARGIN  # up to the margin, the preferred one
    assert router.pick(key) == order[1]  # one more: it spills to the second choice
    for index in [order[0]] * SPILL_MARGIN + [order[1]]:
        router.release(index)
    assert router.in_flight == [0, 0, 0]
    # a call that failed UNAVAILABLE marks the replica down for DOWN_S
    router.release(router.pick(key), ScoringError(grpc.StatusCode.UNAVAILABLE, "gone"))
    assert router.down(order[0]) and router.pick(key) == order[1]
    router.release(order[1])
    clock[0] += DOWN_S + 0.1  # DOWN_S later it is tried again
    assert not router.down(order[0]) and router.pick(key) == order[0]
    router.release(order[0])
    # a request that failed on its preferred replica avoids it
    assert router.pick(key, avoid={order[0]}) == order[1]
    assert router.pick(key, avoid={0, 1, 2}) == order[0]  # every one tried: the preference


@pytest.fixture
def replicas():
    servers = [FakeServer(FakeScorer()).start() for _ in range(3)]
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


def target_of(servers) -> str:
    return "ipv4:" + ",".join(s.target for s in servers)


def keys_seen(server) -> list[str]:
    return [md[PREFIX_KEY_HEADER] for md in server.scorer.metadata if PREFIX_KEY_HEADER in md]


def preferred(client, seq) -> int:
    return rendezvous_order(key_of(seq), client.router.replicas)[0]


def test_requests_sharing_a_prefix_land_on_one_replica(replicas):
    with ScoringClient(
        target_of(replicas), load_balancing="prefix", max_request_tokens=None, timeout=10
    ) as client:
        assert client.router.replicas == [s.target for s in replicas]
        head = random_seq(PREFIX_KEY_TOKENS + 20)  # a multi-turn history, a GRPO prompt
        turns = [head + random_seq(n) for n in (5, 50, 200, 7)]
        for seq in turns:
            result = client.score([seq])
            np.testing.assert_array_equal(result.logprobs[0], ref_logprobs(seq))
        counts = [s.scorer.calls["Score"] for s in replicas]
        assert sorted(counts) == [0, 0, len(turns)]
        assert counts.index(len(turns)) == preferred(client, turns[0])
        holder = replicas[preferred(client, turns[0])]
        assert keys_seen(holder) == [key_of(turns[0])] * len(turns)


def test_different_prefixes_spread_over_the_replicas(replicas):
    with ScoringClient(
        target_of(replicas), load_balancing="prefix", max_request_tokens=None, timeout=10
    ) as client:
        seqs = [random_seq(RNG.integers(20, 400)) for _ in range(90)]
        for seq in seqs:
            client.score([seq], return_logprobs=False)
        counts = [s.scorer.calls["Score"] for s in replicas]
        expected = collections.Counter(preferred(client, seq) for seq in seqs)
        assert counts == [expected[i] for i in range(3)]
        assert all(15 <= n <= 45 for n in counts), counts  # 30 each expected, sd ~4.5


def test_a_down_preferred_replica_sends_the_call_to_the_next_one(replicas):
    with ScoringClient(
        target_of(replicas), load_balancing="prefix", max_request_tokens=None, timeout=10
    ) as client:
        seq = random_seq(300)
        order = rendezvous_order(key_of(seq), client.router.replicas)
        client.score([seq])
        replicas[order[0]].stop()
        result = client.score([seq])  # UNAVAILABLE there: at once to the second choice
        np.testing.assert_array_equal(result.logprobs[0], ref_logprobs(seq))
        assert replicas[order[1]].scorer.calls["Score"] == 1
        assert client.router.down(order[0])
        client.score([seq])  # while down, the next calls go there directly
        assert replicas[order[1]].scorer.calls["Score"] == 2
        assert replicas[order[2]].scorer.calls["Score"] == 0
        assert client.router.in_flight == [0, 0, 0]


def test_an_overloaded_preferred_replica_sends_calls_elsewhere(replicas):
    async def main():
        async with AsyncScoringClient(
            target_of(replicas), load_balancing="prefix", max_request_tokens=None, timeout=20
        ) as client:
            seq = random_seq(300)
            order = rendezvous_order(key_of(seq), client.router.replicas)
            holder = replicas[order[0]].scorer
            holder.gate.clear()  # the preferred replica holds its calls
            n = SPILL_MARGIN + 3
            tasks = [asyncio.ensure_future(client.score([seq])) for _ in range(n)]
            while sum(s.scorer.calls["Score"] for s in replicas) < n:
                await asyncio.sleep(0.02)
            held = holder.calls["Score"]
            assert held == SPILL_MARGIN  # up to the margin, then the others take them
            assert replicas[order[1]].scorer.calls["Score"] == n - SPILL_MARGIN
            holder.gate.set()
            for result in await asyncio.gather(*tasks):
                np.testing.assert_array_equal(result.logprobs[0], ref_logprobs(seq))
            assert client.router.in_flight == [0, 0, 0]

    asyncio.run(main())


def test_a_split_batch_routes_part_by_part(replicas):
    with ScoringClient(
        target_of(replicas), load_balancing="prefix", max_request_tokens=400, timeout=10
    ) as client:
        seqs = [random_seq(300) for _ in range(12)]  # 400-token limit: one per request
        result = client.score(seqs)
        for seq, logprobs in zip(seqs, result.logprobs, strict=True):
            np.testing.assert_array_equal(logprobs, ref_logprobs(seq))
        for i, server in enumerate(replicas):
            mine = sorted(key_of(s) for s in seqs if preferred(client, s) == i)
            assert sorted(keys_seen(server)) == mine
        assert sum(s.scorer.calls["Score"] for s in replicas) == len(seqs)


def test_sync_and_async_clients_route_alike(replicas):
    seqs = [random_seq(RNG.integers(50, 300)) for _ in range(20)]

    with ScoringClient(
        target_of(replicas), load_balancing="prefix", max_request_tokens=None, timeout=10
    ) as client:
        for seq in seqs:
            client.score([seq], return_logprobs=False)
    sync_counts = [s.scorer.calls["Score"] for s in replicas]

    async def main():
        async with AsyncScoringClient(
            target_of(replicas), load_balancing="prefix", max_request_tokens=None, timeout=10
        ) as client:
            for seq in seqs:
                await client.score([seq], return_logprobs=False)

    asyncio.run(main())
    assert [s.scorer.calls["Score"] for s in replicas] == [2 * n for n in sync_counts]
    for server in replicas:  # the same keys, twice each
        assert all(n % 2 == 0 for n in collections.Counter(keys_seen(server)).values())


def test_the_key_travels_without_prefix_routing_too(server):
    seq = random_seq(300)
    with ScoringClient(server.target, max_request_tokens=None, prefix_key_tokens=64) as client:
        assert client.router is None
        client.score([seq, random_seq(10)])
    assert keys_seen(server) == [key_of(seq, 64)]

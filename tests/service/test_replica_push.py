"""``push_weights`` to several replicas, all or none, through real gRPC servers on fake
push engines (no torch).

Three replicas behind ``ipv4:a,b,c`` all switch to the pushed version, each staging
the exact bytes; a replica that refuses a tensor (its model has another shape), or is
gone, fails the push with an error naming it, and no replica switches: the others drop
what they staged and serve the old version. ``replica_targets`` splits address lists
and resolves ``dns:///`` names. The asyncio client does the same (every replica, all or
none, deltas); cancelling its push before every replica prepared aborts it everywhere.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest

from megascore.api.types import WeightTarget
from megascore.v1 import scoring_pb2 as pb
from megascore_client import AsyncScoringClient, ScoringClient, ScoringError
from megascore_client.push.replicas import replica_targets
from tests.service.harness import ServerThread, wait_for
from tests.service.test_weight_push import TARGETS, PushEngine, score_version

TENSORS = {
    "embed": np.arange(12, dtype=np.float32).reshape(4, 3),
    "norm": np.ones(5, dtype=np.float32),
    "experts.0.w1": np.full((2, 2), 0.5, dtype=np.float32),
}


class OtherShapeEngine(PushEngine):
    """A replica whose model has another ``norm`` shape: it refuses the push's."""

    def begin_weight_update(self, names: int, weight_set: str = ""):
        targets = super().begin_weight_update(names)
        return {**targets, "norm": WeightTarget((6,))}


class SlowEngine(PushEngine):
    """A replica whose staging waits for :attr:`gate` (a slow replica)."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def stage_weight(self, *args):
        self.gate.wait(30)
        super().stage_weight(*args)


@pytest.fixture
def replicas(request):
    engines = [PushEngine(), PushEngine(), getattr(request, "param", PushEngine)()]
    servers = [ServerThread(engine, max_batch_wait_ms=1) for engine in engines]
    yield servers
    for server in servers:
        server.stop()


def target(servers) -> str:
    return "ipv4:" + ",".join(s.address for s in servers)


def test_a_push_reaches_every_replica(replicas):
    with ScoringClient(target(replicas), timeout=30) as client:
        result = client.push_weights(TENSORS.items(), weights_version="v1")
    assert result.weights_version == "v1" and result.previous_weights_version == "v0"
    assert [r.weights_version for r in result.replicas] == ["v1"] * 3
    for server in replicas:
        assert score_version(server) == "v1"
        assert server.engine.staged["embed"][2] == TENSORS["embed"].tobytes()
        assert server.engine.aborts == 0


def test_an_explicit_list_of_replicas(replicas):
    with ScoringClient(replicas[0].address, timeout=30) as client:
        result = client.push_weights(
            TENSORS.items(), weights_version="v2", replicas=[s.address for s in replicas[1:]]
        )
    assert len(result.replicas) == 2
    assert [score_version(s) for s in replicas] == ["v0", "v2", "v2"]


@pytest.mark.parametrize("replicas", [OtherShapeEngine], indirect=True)
def test_a_replica_refusing_a_tensor_leaves_every_replica_on_the_old_weights(replicas):
    with ScoringClient(target(replicas), timeout=30) as client:
        with pytest.raises(ScoringError) as info:
            client.push_weights(TENSORS.items(), weights_version="v1")
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert f"replica {replicas[2].address}" in info.value.details
    assert "norm" in info.value.details and "no replica switched" in info.value.details
    for server in replicas:
        assert score_version(server) == "v0"
        assert server.engine.aborts == 1  # what it staged was dropped
        assert not any(event[0] == "commit" for event in server.engine.events)


def test_a_replica_that_is_gone_fails_the_push_and_nothing_switches(replicas):
    gone = replicas[1].address
    replicas[1].stop()
    try:
        with ScoringClient(target(replicas), timeout=30, retries=None) as client:
            with pytest.raises(ScoringError) as info:
                client.push_weights(TENSORS.items(), weights_version="v1")
        assert info.value.code is grpc.StatusCode.UNAVAILABLE
        assert f"replica {gone}" in info.value.details
        for server in (replicas[0], replicas[2]):
            assert score_version(server) == "v0"
            assert not any(event[0] == "commit" for event in server.engine.events)
    finally:
        replicas[1] = ServerThread(PushEngine())  # for the fixture's teardown


def test_replica_targets():
    assert replica_targets("ipv4:10.0.0.5:1,10.0.0.6:2") == ["10.0.0.5:1", "10.0.0.6:2"]
    assert replica_targets("ipv6:[::1]:5") == ["[::1]:5"]
    assert replica_targets("127.0.0.1:5") == ["127.0.0.1:5"]
    resolved = replica_targets("dns:///localhost:5005")
    assert resolved and set(resolved) <= {"127.0.0.1:5005", "[::1]:5005"}
    assert replica_targets("dns://8.8.8.8/localhost:7") == replica_targets("dns:localhost:7")
    assert set(TARGETS) >= set(TENSORS)


# ---- delta pushes ------------------------------------------------------------------------------


def test_a_delta_sends_only_what_changed_and_stages_the_same_bytes(replicas):
    bf16 = {name: t.astype(np.float32) for name, t in TENSORS.items()}
    big = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    with ScoringClient(target(replicas), timeout=30) as client:
        first = client.push_weights({**bf16, "embed": big}.items(), delta=True)
        assert not first.delta and first.num_bytes == 48 + 20 + 16
        patched = big.copy()
        patched[2, 1] = 7.0  # one element: a patch
        second = client.push_weights(
            {**bf16, "embed": patched}.items(), delta=True, weights_version="d2"
        )
        assert second.delta and second.num_bytes == 4 + 4  # one int32 index, one float32
        assert [score_version(s) for s in replicas] == ["d2"] * 3
        for server in replicas:
            staged = server.engine.staged
            assert set(staged) == {"embed"}  # the unchanged tensors were not sent
            assert staged["embed"][2] == patched.tobytes()  # the kept copy, patched
            commits = [e for e in server.engine.events if e[0] == "commit"]
            assert commits[-1] == ("commit", "d2", True)  # a delta is partial
        norm = bf16["norm"] + 1  # every element: whole
        third = client.push_weights({**bf16, "embed": patched, "norm": norm}.items(), delta=True)
        assert third.delta and third.num_bytes == 20
        assert replicas[0].engine.staged["norm"][2] == norm.tobytes()


def test_a_delta_a_replica_cannot_take_falls_back_to_a_full_push(replicas):
    with ScoringClient(target(replicas), timeout=30) as client:
        client.push_weights(TENSORS.items(), delta=True, weights_version="k1")
        replicas[1].stub().LoadWeights(
            pb.LoadWeightsRequest(model="builtin:tiny", weights_version="loaded"), timeout=10
        )
        changed = {**TENSORS, "norm": TENSORS["norm"] * 3}
        result = client.push_weights(changed.items(), delta=True, weights_version="k2")
    assert not result.delta and result.num_bytes == 48 + 20 + 16
    assert [score_version(s) for s in replicas] == ["k2"] * 3
    assert all(s.engine.staged["norm"][2] == changed["norm"].tobytes() for s in replicas)


def test_a_delta_against_a_version_not_served_is_refused_at_begin(replicas):
    server = replicas[0]
    request = pb.UpdateWeightsRequest(
        begin=pb.UpdateWeightsBegin(names=pb.WEIGHT_NAMES_HF, base_weights_version="old")
    )
    with pytest.raises(grpc.RpcError) as info:
        server.stub().UpdateWeights(iter([request]), timeout=10)
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "'old'" in info.value.details() and "'v0'" in info.value.details()
    assert server.engine.events == [] or server.engine.events[-1][0] != "begin"


# ---- the asyncio client ------------------------------------------------------------------------


def test_the_async_client_pushes_to_every_replica_and_sends_deltas(replicas):
    patched = {**TENSORS, "embed": TENSORS["embed"].copy()}
    patched["embed"][1, 2] = -4.0

    async def main():
        async with AsyncScoringClient(target(replicas), timeout=30) as client:
            full = await client.push_weights(TENSORS.items(), delta=True, weights_version="a1")
            delta = await client.push_weights(patched.items(), delta=True, weights_version="a2")
        return full, delta

    full, delta = asyncio.run(main())
    assert [r.weights_version for r in full.replicas] == ["a1"] * 3 and not full.delta
    assert delta.delta and delta.num_bytes == 4 + 4  # one int32 index, one float32
    assert [r.weights_version for r in delta.replicas] == ["a2"] * 3
    for server in replicas:
        assert score_version(server) == "a2"
        assert server.engine.staged["embed"][2] == patched["embed"].tobytes()


@pytest.mark.parametrize("replicas", [OtherShapeEngine], indirect=True)
def test_the_async_client_a_replica_refusing_leaves_every_replica_on_the_old_weights(replicas):
    async def main():
        async with AsyncScoringClient(target(replicas), timeout=30) as client:
            await client.push_weights(TENSORS.items(), weights_version="v1")

    with pytest.raises(ScoringError) as info:
        asyncio.run(main())
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert f"replica {replicas[2].address}" in info.value.details
    assert "no replica switched" in info.value.details
    for server in replicas:
        assert score_version(server) == "v0"
        assert not any(event[0] == "commit" for event in server.engine.events)


@pytest.mark.parametrize("replicas", [SlowEngine], indirect=True)
def test_cancelling_an_async_push_aborts_it_on_every_replica(replicas):
    slow = replicas[2].engine

    async def main():
        async with AsyncScoringClient(target(replicas), timeout=30) as client:
            push = asyncio.ensure_future(client.push_weights(TENSORS.items()))
            while not any(e[0] == "begin" for e in slow.events):  # the push is streaming
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            push.cancel()
            with pytest.raises(asyncio.CancelledError):
                await push
            assert await client.score([[1, 2, 3]]) is not None  # the loop kept running

    asyncio.run(main())
    slow.gate.set()
    for server in replicas:
        wait_for(lambda s=server: s.engine.aborts >= 1, what=f"{server.address} aborted")
        assert score_version(server) == "v0"
        assert not any(event[0] == "commit" for event in server.engine.events)

"""``push_weights`` to several replicas, all or none, through real gRPC servers on fake
push engines (no torch).

Three replicas behind ``ipv4:a,b,c`` all switch to the pushed version, each staging
the exact bytes; a replica that refuses a tensor (its model has another shape), or is
gone, fails the push with an error naming it, and no replica switches: the others drop
what they staged and serve the old version. ``replica_targets`` splits address lists
and resolves ``dns:///`` names.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from megascore.types import WeightTarget
from megascore_client import ScoringClient, ScoringError
from megascore_client.replica_push import replica_targets
from tests.service.harness import ServerThread
from tests.service.test_weight_push import TARGETS, PushEngine, score_version

TENSORS = {
    "embed": np.arange(12, dtype=np.float32).reshape(4, 3),
    "norm": np.ones(5, dtype=np.float32),
    "experts.0.w1": np.full((2, 2), 0.5, dtype=np.float32),
}


class OtherShapeEngine(PushEngine):
    """A replica whose model has another ``norm`` shape: it refuses the push's."""

    def begin_weight_update(self, names: int):
        targets = super().begin_weight_update(names)
        return {**targets, "norm": WeightTarget((6,))}


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

"""Requests pinned to a weights version (``options.weights_version``), through the real
gRPC server and batcher on a fake engine, and the SDK's re-send over two replicas.

A pin on the served version is scored (and may share a step with unpinned requests);
a pin on another version fails with FAILED_PRECONDITION naming both versions and the
server keeps serving; a swap queued before a pinned request is applied before its
step (the pin on the version being committed is served, the pin on the old one is
refused), while one queued after it waits for it; an SDK stream's pinned submit is
scored on its version or fails the stream; the engine refuses a pinned batch of another
version itself. The SDK re-sends a refused pinned request over a
round-robin channel until the replica with that version answers.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from megascore.api.errors import WrongVersionError
from megascore.v1 import scoring_pb2 as pb
from megascore_client import ScoringClient, ScoringError
from tests.service.fake_engine import FakeEngine, compute
from tests.service.harness import Req, ServerThread, check_response, engine_held, serving, wait_for


def pinned(req: Req, version: str) -> pb.ScoreRequest:
    request = req.proto()
    request.options.weights_version = version
    return request


@pytest.fixture(scope="module")
def server():
    yield from serving(FakeEngine(version="v0"), max_tokens_per_batch=64, max_batch_wait_ms=5)


def load(server, version: str) -> None:
    server.stub().LoadWeights(
        pb.LoadWeightsRequest(model="builtin:tiny", weights_version=version), timeout=10
    )


def test_pin_on_the_served_version_is_scored_with_it(server):
    load(server, "a1")
    req = Req([[1, 2, 3], [4, 5]], request_id="p1", losses=("nll",))
    check_response(server.stub().Score(pinned(req, "a1"), timeout=10), req, "a1")


def test_pin_on_another_version_fails_naming_both_and_the_server_serves_on(server):
    load(server, "a2")
    stub = server.stub()
    with pytest.raises(grpc.RpcError) as info:
        stub.Score(pinned(Req([[1, 2, 3]], request_id="p2"), "a1"), timeout=10)
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "'a1'" in info.value.details() and "'a2'" in info.value.details()
    assert "weights_version" in info.value.details()
    req = Req([[9, 8]], request_id="after")
    check_response(stub.Score(req.proto(), timeout=10), req, "a2")


def test_sdk_stream_pins_are_scored_on_their_version_or_fail_the_stream(server):
    load(server, "s1")
    with ScoringClient(server.address, timeout=10) as client:
        with client.stream() as stream:
            ok = stream.submit([[1, 2, 3], [4, 5]], weights_version="s1").result(10)
            assert ok.weights_version == "s1"
            assert len(ok.logprobs) == 2
        with client.stream() as stream:  # a stream is on one replica: no re-send
            with pytest.raises(ScoringError) as info:
                stream.submit([[1, 2]], weights_version="s0").result(10)
    assert info.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "'s0'" in info.value.details and "'s1'" in info.value.details
    req = Req([[7, 7]], request_id="after-stream")
    check_response(server.stub().Score(req.proto(), timeout=10), req, "s1")


def test_too_long_pin_is_invalid_argument(server):
    with pytest.raises(grpc.RpcError) as info:
        server.stub().Score(pinned(Req([[1, 2]]), "x" * 300), timeout=10)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "options.weights_version" in info.value.details()


def test_swap_queued_before_a_pin_is_applied_first(server):
    load(server, "b0")
    engine, stub = server.engine, server.stub()
    old = Req([[3, 3, 3]], request_id="old")
    with engine_held(server):
        early = stub.Score.future(pinned(old, "b0"), timeout=30)  # before the swap
        wait_for(lambda: server.handles.batcher.queue_depth == 1, what="the early request")
        swap = stub.LoadWeights.future(
            pb.LoadWeightsRequest(model="builtin:tiny", weights_version="b1"), timeout=30
        )
        wait_for(lambda: server.handles.batcher.barriers_waiting == 1, what="the swap")
        new = Req([[5, 6, 7]], request_id="new")
        on_new = stub.Score.future(pinned(new, "b1"), timeout=30)
        stale = stub.Score.future(pinned(Req([[2, 2]], request_id="stale"), "b0"), timeout=30)
        mixed = Req([[8, 8, 8, 8]], request_id="mixed")
        unpinned = stub.Score.future(mixed.proto(), timeout=30)
        wait_for(lambda: server.handles.batcher.queue_depth == 4, what="the later requests")
    check_response(early.result(), old, "b0")
    assert swap.result().weights_version == "b1"
    check_response(on_new.result(), new, "b1")
    check_response(unpinned.result(), mixed, "b1")
    with pytest.raises(grpc.RpcError) as info:
        stale.result()
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "'b0'" in info.value.details() and "'b1'" in info.value.details()
    # every step ran on the version its pinned requests named
    for batch, version in engine.steps:
        assert batch.weights_version in ("", version)


def test_engine_refuses_a_pinned_batch_of_another_version():
    engine = FakeEngine(version="v3")
    batch = Req([[1, 2, 3]]).batch()
    pinned_batch = type(batch)(**{**batch.__dict__, "weights_version": "v2"})
    with pytest.raises(WrongVersionError, match="'v2'.*'v3'"):
        engine.score(pinned_batch)
    assert engine.steps == []
    same = type(batch)(**{**batch.__dict__, "weights_version": "v3"})
    np.testing.assert_array_equal(engine.score(same).logprobs, compute(batch, "v3").logprobs)


def test_sdk_resends_a_pinned_request_to_the_replica_serving_its_version():
    stale, fresh = ServerThread(FakeEngine(version="v1")), ServerThread(FakeEngine(version="v2"))
    try:
        target = f"ipv4:{stale.address},{fresh.address}"
        with ScoringClient(target, load_balancing="round_robin", timeout=10) as client:
            client.wait_until_serving(10)
            for _ in range(6):  # round robin starts on either replica
                result = client.score([[1, 2, 3], [4, 5]], weights_version="v2")
                assert result.weights_version == "v2"
            with pytest.raises(ScoringError) as info:
                client.score([[1, 2]], weights_version="v9")
            assert info.value.code is grpc.StatusCode.FAILED_PRECONDITION
            assert "'v9'" in info.value.details
            padded = client.score_padded(
                np.array([[1, 2, 3, 0]]), np.array([3]), weights_version="v2"
            )
            assert padded.shape == (1, 4)
            with client.stream() as stream:  # a stream is on one replica: no re-send
                assert stream.submit([[1, 2]], weights_version="").result(10).weights_version
        assert len(fresh.engine.steps) >= 7
        assert all(batch.weights_version in ("", "v2") for batch, _ in fresh.engine.steps)
        assert all(batch.weights_version == "" for batch, _ in stale.engine.steps)
    finally:
        stale.stop()
        fresh.stop()

"""Lifecycle: health, graceful drain, engine failures, LoadWeights, model info, reflection."""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from megascore.api.errors import WorkerLostError
from megascore.v1 import scoring_pb2 as pb
from megascore.v1 import scoring_pb2_grpc as pb_grpc
from megascore_server.gate import SHUTTING_DOWN_MESSAGE
from megascore_server.status import INTERNAL_MESSAGE
from tests.service.fake_engine import MAX_TOP_K, VOCAB, FakeEngine
from tests.service.harness import Req, ServerThread, check_response, engine_held, serving, wait_for

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SCORER = "megascore.v1.Scorer"


@pytest.fixture(scope="module")
def server():
    yield from serving(FakeEngine(), max_batch_wait_ms=1)


def test_health_not_serving_until_ready_then_serving_then_draining():
    engine = FakeEngine()
    srv = ServerThread(engine, start=False)
    try:
        srv.call(srv.server.start())
        assert srv.health() == NOT_SERVING and srv.health(SCORER) == NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            srv.stub().Score(Req([[1, 2]]).proto(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        srv.call(srv.handles.gate.open())
        assert srv.health() == SERVING and srv.health(SCORER) == SERVING
        req = Req([[1, 2, 3]], request_id="r")
        check_response(srv.stub().Score(req.proto(), timeout=5), req)

        # Drain: health flips at once, the in-flight request still finishes.
        watch = health_pb2_grpc.HealthStub(srv.channel()).Watch(
            health_pb2.HealthCheckRequest(service=SCORER), timeout=30
        )
        assert next(watch).status == SERVING
        with engine_held(srv) as blocker:
            inflight = Req([[4, 5, 6]], request_id="inflight")
            future = srv.stub().Score.future(inflight.proto(), timeout=30)
            wait_for(lambda: srv.handles.batcher.queue_depth == 1)
            stopping = asyncio.run_coroutine_threadsafe(srv.handles.stop(grace=20), srv.loop)
            assert next(watch).status == NOT_SERVING
            watch.cancel()
            refused_at = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                srv.stub().Score(req.proto(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert SHUTTING_DOWN_MESSAGE in info.value.details()
            assert time.monotonic() - refused_at < 10  # fails fast, not at the drain's end (20 s)
            assert not blocker.done()
        check_response(future.result(timeout=30), inflight)
        assert stopping.result(timeout=30) is True
        assert engine.shutdown_called == 1
    finally:
        srv.stop()
    assert engine.shutdown_called == 1  # stop() is idempotent


def test_calls_racing_the_stop_get_unavailable_never_cancelled():
    """Clients keep sending while stop() runs: each call is OK or UNAVAILABLE.

    grpc core cancels (CANCELLED) a call that reaches it after its shutdown began;
    the drain keeps clients quiet at that instant (docs/reliability.md). Before the
    fix, each round had several CANCELLED calls.
    """
    codes: collections.Counter = collections.Counter()
    for _ in range(3):
        srv = ServerThread(FakeEngine(), max_batch_wait_ms=1)
        stop = threading.Event()
        lock = threading.Lock()

        def hammer(address=srv.address, stop=stop, lock=lock):
            with grpc.insecure_channel(address) as channel:
                stub = pb_grpc.ScorerStub(channel)
                request = Req([[1, 2, 3, 4]]).proto()
                while not stop.is_set():
                    try:
                        stub.Score(request, timeout=10)
                        code = grpc.StatusCode.OK
                    except grpc.RpcError as exc:
                        code = exc.code()
                    with lock:
                        codes[code] += 1

        threads = [threading.Thread(target=hammer, daemon=True) for _ in range(6)]
        try:
            for thread in threads:
                thread.start()
            wait_for(lambda: codes[grpc.StatusCode.OK] > 20, what="calls answered")
            assert srv.call(srv.handles.stop(grace=5), timeout=60) is True
            time.sleep(0.3)  # clients keep calling the stopped server
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)
            srv.stop()
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes
    assert codes[grpc.StatusCode.UNAVAILABLE] > 0


def test_open_idle_stream_ends_unavailable_at_drain_without_holding_it():
    srv = ServerThread(FakeEngine(), max_batch_wait_ms=1)
    try:
        messages: queue.Queue = queue.Queue()
        first = Req([[1, 2, 3]], request_id="s0")
        messages.put(first.proto())
        call = srv.stub().ScoreStream(iter(messages.get, None), timeout=60)
        check_response(next(call), first)
        start = time.monotonic()
        assert srv.call(srv.handles.stop(grace=30), timeout=60) is True
        assert time.monotonic() - start < 10, "the idle stream held the drain"
        with pytest.raises(grpc.RpcError) as info:
            next(call)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert SHUTTING_DOWN_MESSAGE in info.value.details()
        messages.put(None)
    finally:
        srv.stop()


def test_engine_exception_fails_only_its_step(server):
    engine = server.engine
    stub = server.stub()
    others = [Req([[i + 1] * 4], request_id=f"o{i}") for i in range(3)]
    gate = threading.Event()
    engine.gate, engine.started = gate, threading.Event()
    failing = stub.Score.future(Req([[3, 3]], request_id="doomed").proto(), timeout=30)
    assert engine.started.wait(10)
    futures = [stub.Score.future(r.proto(), timeout=30) for r in others]
    wait_for(lambda: server.handles.batcher.queue_depth == 3)
    engine.fail_next = RuntimeError("secret internal detail")
    engine.gate = None
    gate.set()
    with pytest.raises(grpc.RpcError) as info:
        failing.result()
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert INTERNAL_MESSAGE in info.value.details() and "secret" not in info.value.details()
    assert "request_id=doomed" in info.value.details()
    for req, future in zip(others, futures, strict=True):
        check_response(future.result(), req, engine.version)  # a load may have run before
    assert server.health() == SERVING


def test_model_info(server):
    info = server.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert info.name == "fake" and info.vocab_size == VOCAB and info.max_top_k == MAX_TOP_K
    assert list(info.loss_names) == ["mean_nll", "nll"]
    assert info.max_tokens_per_batch == server.config.max_tokens_per_batch
    assert info.max_request_tokens == server.config.max_request_tokens
    assert info.max_message_bytes == server.config.max_message_bytes > 0
    assert info.max_sequence_length == 512 and info.parallel.world_size == 1
    assert list(info.moe_metric_names) == ["load_balancing_loss", "z_loss"]


def test_reflection_lists_services(server):
    stub = reflection_pb2_grpc.ServerReflectionStub(server.channel())
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (response,) = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
    names = {s.name for s in response.list_services_response.service}
    assert {SCORER, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def load(stub, model: str, version: str = ""):
    return stub.LoadWeights(pb.LoadWeightsRequest(model=model, weights_version=version), timeout=30)


def test_load_weights_between_steps_and_failures(server):
    engine = server.engine
    stub = server.stub()
    old = engine.version
    before = Req([[10, 11, 12]], request_id="before")
    after = Req([[13, 14]], request_id="after")
    with engine_held(server):
        events_since = len(engine.events) + 1
        f_before = stub.Score.future(before.proto(), timeout=30)
        wait_for(lambda: server.handles.batcher.queue_depth == 1)
        f_load = stub.LoadWeights.future(
            pb.LoadWeightsRequest(model="hf:/ckpt/new", weights_version="w-new"), timeout=30
        )
        wait_for(lambda: server.handles.batcher.barriers_waiting == 1)
        f_after = stub.Score.future(after.proto(), timeout=30)
        wait_for(lambda: server.handles.batcher.queue_depth == 2)
    loaded = f_load.result()
    assert loaded.weights_version == "w-new" and loaded.previous_weights_version == old
    assert loaded.load_ms >= 0
    check_response(f_before.result(), before, old)
    check_response(f_after.result(), after, "w-new")
    assert engine.events[events_since:] == [("step", 1), ("load", "w-new"), ("step", 1)]
    assert server.stub().GetModelInfo(pb.GetModelInfoRequest()).weights_version == "w-new"

    # Derived version when none is given.
    derived = load(stub, "megatron:/ckpt/other")
    assert derived.weights_version == engine.version != "w-new"
    current = engine.version

    for model, code, parts in [
        ("hf:/ckpt/bad", grpc.StatusCode.FAILED_PRECONDITION, ["decoder.layers.0.weight"]),
        ("hf:/ckpt/crash", grpc.StatusCode.FAILED_PRECONDITION, ["RuntimeError", "disk on fire"]),
        ("", grpc.StatusCode.INVALID_ARGUMENT, ["model: required"]),
        ("tiny", grpc.StatusCode.INVALID_ARGUMENT, ["'tiny'", "expected hf:DIR"]),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            load(stub, model)
        assert info.value.code() == code
        for part in parts:
            assert part in info.value.details()
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            assert f"still serving weights {current!r}" in info.value.details()
    req = Req([[1, 2, 3]], request_id="still-old")
    check_response(stub.Score(req.proto(), timeout=5), req, current)


def test_worker_lost_is_unavailable_and_not_serving():
    engine = FakeEngine()
    srv = ServerThread(engine, max_batch_wait_ms=0)
    try:
        stub = srv.stub()
        gate = threading.Event()
        engine.gate = gate
        first = stub.Score.future(Req([[1, 2]], request_id="first").proto(), timeout=30)
        assert engine.started.wait(10)
        queued = stub.Score.future(Req([[3, 4]], request_id="queued").proto(), timeout=30)
        wait_for(lambda: srv.handles.batcher.queue_depth == 1)
        engine.fail_next = WorkerLostError("rank 1 timed out in broadcast")
        gate.set()
        for future, rid in [(first, "first"), (queued, "queued")]:
            with pytest.raises(grpc.RpcError) as info:
                future.result()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "rank 1 timed out" in info.value.details() and rid in info.value.details()
        wait_for(lambda: srv.health() == NOT_SERVING and srv.health(SCORER) == NOT_SERVING)
        assert srv.handles.fatal.is_set()
        assert isinstance(srv.handles.fatal_error, WorkerLostError)
        with pytest.raises(grpc.RpcError) as info:
            stub.Score(Req([[5]]).proto(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as info:
            load(stub, "hf:/x")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as info:
            list(stub.ScoreStream(iter([Req([[5]], request_id="s").proto()]), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop()


def test_worker_lost_during_load_weights():
    srv = ServerThread(FakeEngine())
    try:
        with pytest.raises(grpc.RpcError) as info:
            load(srv.stub(), "hf:/ckpt/lost")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "RELOAD" in info.value.details()
        assert srv.handles.fatal.is_set()
        wait_for(lambda: srv.health() == NOT_SERVING)
    finally:
        srv.stop()


def test_stream_error_names_request_id_and_ends_stream(server):
    stub = server.stub()
    good = [Req([[1, 2, 3]], request_id=f"g{i}") for i in range(2)]
    bad = Req([[1, 2, 3]], request_id="bad-one", top_k=MAX_TOP_K + 1)
    messages = [
        good[0].proto(),
        good[1].proto(),
        bad.proto(),
        Req([[4, 5]], request_id="x").proto(),
    ]
    call = stub.ScoreStream(iter(messages), timeout=30)
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for response in call:
            received.append(response)
    assert [r.request_id for r in received] == ["g0", "g1"]
    for req, response in zip(good, received, strict=True):
        check_response(response, req, server.engine.version)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id=bad-one (stream message 2)" in info.value.details()
    assert "options.top_k" in info.value.details()

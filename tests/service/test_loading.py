"""Model loading: the server answers (NOT_SERVING, UNAVAILABLE) before the engine exists.

The engine is built by a slow factory on the engine thread
(``ServerHandles.load_engine``) while the real in-process server is running.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from megascore.api.errors import CheckpointError, UnavailableError
from megascore.v1 import scoring_pb2 as pb
from tests.service.fake_engine import FakeEngine
from tests.service.harness import Req, ServerThread, check_response, wait_for

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SCORER = "megascore.v1.Scorer"


class SlowFactory:
    """Builds a FakeEngine once ``release`` is set; records the thread it ran on."""

    def __init__(self, error: BaseException | None = None):
        self.error = error
        self.release = threading.Event()
        self.started = threading.Event()
        self.thread: str | None = None
        self.engine: FakeEngine | None = None

    def __call__(self) -> FakeEngine:
        self.thread = threading.current_thread().name
        self.started.set()
        assert self.release.wait(30), "test never released the load"
        if self.error is not None:
            raise self.error
        self.engine = FakeEngine()
        return self.engine


def assert_loading(srv: ServerThread) -> None:
    """Health NOT_SERVING and every Scorer RPC UNAVAILABLE with "loading"."""
    assert srv.health() == NOT_SERVING and srv.health(SCORER) == NOT_SERVING
    stub = srv.stub()
    calls = {
        "Score": lambda: stub.Score(Req([[1, 2, 3]]).proto(), timeout=5),
        "ScoreStream": lambda: list(stub.ScoreStream(iter([Req([[1, 2]]).proto()]), timeout=5)),
        "GetModelInfo": lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5),
        "LoadWeights": lambda: stub.LoadWeights(pb.LoadWeightsRequest(model="hf:/x"), timeout=5),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, name
        assert "loading" in info.value.details(), (name, info.value.details())


def test_not_serving_while_loading_then_serving_on_the_engine_thread():
    srv = ServerThread(None, max_batch_wait_ms=0)
    factory = SlowFactory()
    try:
        watch = health_pb2_grpc.HealthStub(srv.channel()).Watch(
            health_pb2.HealthCheckRequest(service=SCORER), timeout=30
        )
        assert next(watch).status == NOT_SERVING
        loading = srv.load(factory)
        assert factory.started.wait(10)
        assert_loading(srv)
        assert srv.handles.batcher is None and not loading.done()

        factory.release.set()
        engine = loading.result(30)
        assert next(watch).status == SERVING
        watch.cancel()
        assert srv.health() == SERVING and srv.health(SCORER) == SERVING
        req = Req([[1, 2, 3], [4, 5]], request_id="after-load", top_k=2)
        check_response(srv.stub().Score(req.proto(), timeout=5), req)
        assert srv.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=5).name == "fake"
        # Built on the engine thread, the one thread that also runs every step.
        assert factory.thread.startswith("megascore-engine")
        assert engine.threads == {factory.thread}
    finally:
        srv.stop()
    assert engine.shutdown_called == 1


def test_failed_load_never_serves():
    srv = ServerThread(None)
    factory = SlowFactory(CheckpointError("hf:/ckpt: missing model.safetensors"))
    try:
        loading = srv.load(factory)
        assert factory.started.wait(10)
        factory.release.set()
        with pytest.raises(CheckpointError, match="missing model.safetensors"):
            loading.result(30)
        assert_loading(srv)
        assert srv.call(srv.handles.stop(0.0, engine_timeout_s=10)) is True
    finally:
        srv.stop()


def test_limits_not_fitting_the_model_shut_the_built_engine_down():
    srv = ServerThread(None, max_sequence_length=4096)  # the fake model's maximum is 512
    factory = SlowFactory()
    factory.release.set()
    try:
        with pytest.raises(ValueError, match="exceeds the model's 512"):
            srv.load(factory).result(30)
        assert_loading(srv)
        assert srv.call(srv.handles.stop(0.0, engine_timeout_s=10)) is True
    finally:
        srv.stop()
    assert factory.engine.shutdown_called == 1  # workers get their SHUTDOWN


def test_stop_while_loading_does_not_wait_and_shuts_the_late_engine_down():
    srv = ServerThread(None)
    factory = SlowFactory()
    try:
        loading = srv.load(factory)
        assert factory.started.wait(10)
        # The load cannot be interrupted: stop() does not wait for it past its timeout.
        assert srv.call(srv.handles.stop(0.0, engine_timeout_s=0.2)) is False
        with pytest.raises(grpc.RpcError) as info:
            srv.health()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # server stopped
        factory.release.set()
        with pytest.raises(UnavailableError, match="stopped while the model was loading"):
            loading.result(30)
        wait_for(lambda: factory.engine is not None and factory.engine.shutdown_called == 1)
        assert srv.handles.batcher is None and not srv.handles.health.serving
    finally:
        srv.stop()
    assert factory.engine.shutdown_called == 1

"""Bytes that do not parse, huge strings, and target ids / rollout logprobs that do not
fit: INVALID_ARGUMENT with a short message naming the field (and the sequence).

Raw bytes go through generic channel methods (no serializer), so the server sees
exactly what a hostile client sends. The server keeps serving afterwards, and the
log has no traceback and at most one line about unparseable requests.
"""

from __future__ import annotations

import logging

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from megascore.api.wire import encode_array
from megascore.v1 import scoring_pb2 as pb
from megascore_server.status import MAX_MESSAGE_CHARS, status_for
from megascore_server.validation import MAX_ID_CHARS
from tests.service.fake_engine import MAX_TOP_K, VOCAB, FakeEngine
from tests.service.harness import Req, check_response, serving
from tests.service.test_weight_push import EMBED, NORM, PushEngine, begin, chunk, commit, full_push

GARBAGE = (b"\xff\xff\xff", b"`", b"\xb9", b"\x0a\x05ab", b"\x12\x80\x80\x80\x80\x10")
LONG = 20_000
METHODS = {  # method -> its request message type
    "/megascore.v1.Scorer/Score": "megascore.v1.ScoreRequest",
    "/megascore.v1.Scorer/GetModelInfo": "megascore.v1.GetModelInfoRequest",
    "/megascore.v1.Scorer/LoadWeights": "megascore.v1.LoadWeightsRequest",
    "/grpc.health.v1.Health/Check": "grpc.health.v1.HealthCheckRequest",
}
STREAM = "/megascore.v1.Scorer/ScoreStream"


@pytest.fixture(scope="module")
def server():
    yield from serving(FakeEngine(), max_batch_wait_ms=1)


def _unary(server, method: str, payload: bytes) -> grpc.RpcError:
    call = server.channel().unary_unary(method)  # no serializers: raw bytes
    with pytest.raises(grpc.RpcError) as info:
        call(payload, timeout=10)
    return info.value


def _assert_serving(server) -> None:
    req = Req([[1, 2, 3], [4]], request_id="after")
    check_response(server.stub().Score(req.proto(), timeout=10), req)


@pytest.mark.parametrize("method", list(METHODS))
def test_garbage_bytes_are_invalid_argument_on_every_rpc(server, method, caplog):
    caplog.set_level(logging.INFO)
    for payload in GARBAGE:
        error = _unary(server, method, payload)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (payload, error.details())
        assert error.details().startswith(f"request does not parse as {METHODS[method]}: ")
        assert f"({len(payload)} bytes)" in error.details()
    assert "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len([r for r in caplog.records if "does not parse" in r.getMessage()]) <= 1
    _assert_serving(server)


def test_garbage_mid_stream_ends_the_stream_invalid_argument(server, caplog):
    caplog.set_level(logging.INFO)
    good = [Req([[1, 2]], request_id=f"s{i}") for i in range(2)]
    payloads = [req.proto().SerializeToString() for req in good] + [b"\xff\xff\xff"]
    payloads.append(good[0].proto().SerializeToString())  # never answered
    call = server.channel().stream_stream(STREAM)
    responses = call(iter(payloads), timeout=10)
    got = []
    with pytest.raises(grpc.RpcError) as info:
        for raw in responses:
            got.append(pb.ScoreResponse.FromString(raw))
    assert [r.request_id for r in got] == ["s0", "s1"]
    for response, req in zip(got, good, strict=True):
        check_response(response, req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(
        "request does not parse as megascore.v1.ScoreRequest: stream message 2: "
    )
    assert "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    _assert_serving(server)


def test_garbage_first_stream_message(server):
    call = server.channel().stream_stream(STREAM)
    with pytest.raises(grpc.RpcError) as info:
        list(call(iter([b"\xb9"]), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stream message 0" in info.value.details()


def _short_invalid(error: grpc.RpcError, *names: str) -> None:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert len(error.details()) < 512, len(error.details())
    for name in names:
        assert name in error.details()
    assert f"({LONG} characters)" in error.details()


def _score(server, request: pb.ScoreRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        server.stub().Score(request, timeout=10)
    return info.value


def test_long_request_id_is_refused_with_a_short_message(server):
    request = Req([[1, 2]], request_id="R" * LONG).proto()
    _short_invalid(_score(server, request), "request_id", f"more than {MAX_ID_CHARS}")
    request.lengths.data = b"\x01"  # also malformed: still a short message
    _short_invalid(_score(server, request), "request_id")
    stream = server.stub().ScoreStream(iter([Req([[1]]).proto(), request]), timeout=10)
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    _short_invalid(info.value, "request_id", "(stream message 1)")


def test_long_loss_name_is_refused_with_a_short_message(server):
    request = Req([[1, 2]], losses=("nll", "L" * LONG)).proto()
    _short_invalid(_score(server, request), "options.losses[1]", "unknown loss")


@pytest.mark.parametrize("field", ["model", "weights_version"])
def test_long_load_weights_strings_are_refused(server, field):
    fields = {"model": "builtin:tiny@1", "weights_version": "v1", field: "M" * LONG}
    with pytest.raises(grpc.RpcError) as info:
        server.stub().LoadWeights(pb.LoadWeightsRequest(**fields), timeout=10)
    _short_invalid(info.value, f"{field}: {LONG} characters")
    _assert_serving(server)


@pytest.fixture(scope="module")
def push_server():
    yield from serving(PushEngine(), max_batch_wait_ms=1)


LONG_PUSHES = {  # UpdateWeights streams with a 20,000-character string -> what the error names
    "first tensor name": ([begin(), chunk("N" * LONG, (5,), NORM), commit()], "message 1, tensor"),
    "name after a half-sent tensor": (
        [begin(), chunk("embed", (4, 3), EMBED[:8]), chunk("N" * LONG, (5,), NORM)],
        "message 2, tensor",
    ),
    "commit weights_version": (
        [*full_push()[:-1], commit("V" * LONG)],
        f"commit.weights_version: {LONG} characters",
    ),
}


@pytest.mark.parametrize("case", list(LONG_PUSHES))
def test_long_update_weights_strings_are_refused(push_server, case):
    messages, where = LONG_PUSHES[case]
    with pytest.raises(grpc.RpcError) as info:
        push_server.stub().UpdateWeights(iter(messages), timeout=10)
    _short_invalid(info.value, where)
    assert push_server.stub().UpdateWeights(iter(full_push(case)), timeout=10).weights_version


def test_long_health_service_name_is_answered(server):
    request = health_pb2.HealthCheckRequest(service="S" * LONG).SerializeToString()
    error = _unary(server, "/grpc.health.v1.Health/Check", request)
    assert error.code() == grpc.StatusCode.NOT_FOUND


def test_every_status_message_is_capped():
    from megascore.api.errors import CheckpointError

    code, message = status_for(CheckpointError("x" * 100_000), "id")
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    full = len("request_id=id: ") + 100_000
    assert len(message) <= MAX_MESSAGE_CHARS + 40 and f"({full} characters)" in message


def test_garbage_on_reflection_stream(server):
    call = server.channel().stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    )
    with pytest.raises(grpc.RpcError) as info:
        list(call(iter([b"\xff\xff\xff"]), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(
        "request does not parse as grpc.reflection.v1alpha.ServerReflectionRequest: "
    )


def test_garbage_is_counted_as_invalid_argument(server):
    requests = server.handles.metrics.requests
    counter = requests.labels(front="grpc", rpc="Score", code="INVALID_ARGUMENT")
    before = counter._value.get()
    for payload in GARBAGE:
        _unary(server, "/megascore.v1.Scorer/Score", payload)
    assert counter._value.get() - before == len(GARBAGE)


def _scored_inputs_request(case: str) -> pb.ScoreRequest:
    """A request of sequences [1, 2, 3] and [4, 5] (5 tokens) with one bad field."""
    request = Req([[1, 2, 3], [4, 5]], request_id=f"bad-{case}").proto()
    targets = np.zeros((5, 2), dtype=np.int64)
    rollout = np.full(5, -1.0)
    if case == "target_id_out_of_range":
        targets[4, 1] = VOCAB  # sequence 1 position 1
    if case == "too_many_target_ids":
        targets = np.zeros((5, MAX_TOP_K + 1), dtype=np.int64)
    if case == "target_ids_size":
        targets = np.zeros(7, dtype=np.int64)
    if case == "rollout_nan":
        rollout[1] = np.nan  # sequence 0 position 1
    if case == "rollout_size":
        rollout = rollout[:4]
    if case == "importance_weights_without_rollout":
        request.options.return_importance_weights = True
        return request
    if case == "ratio_cap":
        request.options.mismatch_ratio_cap = 0.5
    request.target_ids.CopyFrom(encode_array(targets))
    request.rollout_logprobs.CopyFrom(encode_array(rollout))
    return request


SCORED_INPUT_ERRORS = {
    "target_id_out_of_range": f"target_ids: sequence 1 position 1: ids must be in [0, {VOCAB})",
    "too_many_target_ids": f"target_ids: {MAX_TOP_K + 1} ids per token, more than max_target_ids",
    "target_ids_size": "target_ids",
    "rollout_nan": "rollout_logprobs: sequence 0 position 1: not finite",
    "rollout_size": "rollout_logprobs: 4 values, expected 5",
    "importance_weights_without_rollout": "options.return_importance_weights: needs rollout",
    "ratio_cap": "options.mismatch_ratio_cap: 0.5 is invalid; it must be finite and > 1",
}


@pytest.mark.parametrize("case", list(SCORED_INPUT_ERRORS))
def test_bad_target_ids_and_rollout_logprobs_are_invalid_argument(server, case):
    """Issue 22's inputs on the wire: INVALID_ARGUMENT naming the field (and the sequence
    and position where the fault is in one), and the server keeps serving."""
    with pytest.raises(grpc.RpcError) as info:
        server.stub().Score(_scored_inputs_request(case), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert SCORED_INPUT_ERRORS[case] in info.value.details(), info.value.details()
    assert f"bad-{case}" in info.value.details()
    _assert_serving(server)

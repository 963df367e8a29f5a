"""Issue 7 (CI-short): hostile input against the shared ``--nproc 2`` TP=2 server.

A hypothesis fuzzer builds ScoreRequests from a valid base plus mutations (raw bytes
in the arrays, wrong / unknown dtype tags, truncated data, wrong lengths, huge and
negative values, missing fields, unknown losses, NaN temperatures, giant top_k ...)
and sends them with the raw stub; another sends truncated / garbage bytes at the wire
level. Every answer must be a shape-correct result or a documented error:

* INVALID_ARGUMENT / RESOURCE_EXHAUSTED for a request that parses but is invalid,
  with a message that fits the metadata (strings of up to 20,000 characters quoted
  as a short prefix);
* INVALID_ARGUMENT "request does not parse as megascore.v1.ScoreRequest: ..." for bytes
  that do not parse, on every RPC and mid-stream, with no traceback in the server log
  and at most one log line about them per 10 s;
* FAILED_PRECONDITION / INVALID_ARGUMENT for LoadWeights of a model that cannot load.

No call may hang (60 s deadline each) or break the replica: afterwards both ranks are
the same processes, health is SERVING and a valid request is answered bit-identically.
"""

from __future__ import annotations

import time

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megascore.v1 import scoring_pb2 as pb
from megascore_server.status import MAX_MESSAGE_CHARS
from testkit.hostile import (
    AMBIGUOUS,
    BENIGN,
    CERTAIN,
    DEADLINE_S,
    GARBAGE,
    INVALID,
    PROBE,
    UNLOADABLE_MODELS,
    UNPARSEABLE,
    assert_quiet_log,
    check_ok,
    hostile_requests,
    log_size,
    same_answer,
    send,
    wire_payloads,
)
from testkit.reference import VOCAB, WEIGHTS
from tests.e2e.serve import SERVING

FUZZ = settings(
    max_examples=2000,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def fuzz_target(shared_tp2):
    """The shared TP=2 server, its ranks and its answer to PROBE before any hostile input."""
    server = shared_tp2
    ranks = server.rank_pids()
    assert sorted(ranks) == [0, 1], ranks
    probe = server.stub().Score(PROBE, timeout=DEADLINE_S)
    check_ok(PROBE, probe)
    yield server, ranks, probe
    # The replica survived everything: same ranks, SERVING, same answer.
    assert server.running() and server.rank_pids() == ranks, server.output()
    assert server.health() == SERVING
    assert same_answer(server.stub().Score(PROBE, timeout=DEADLINE_S), probe)


@pytest.mark.timeout(900)
def test_fuzzed_requests_get_results_or_documented_errors(fuzz_target):
    server, _, _ = fuzz_target
    stub = server.stub()
    seen: dict[str, int] = {}

    @FUZZ
    @given(hostile_requests())
    def one(case):
        request, applied = case
        code, answer = send(stub, request)
        seen[code.name] = seen.get(code.name, 0) + 1
        if code is grpc.StatusCode.OK:
            assert not applied & set(CERTAIN) or applied & set(AMBIGUOUS), (applied, request)
            check_ok(request, answer)
        else:
            assert code in INVALID, (code, answer, applied, request)
            assert len(answer) <= MAX_MESSAGE_CHARS, (code, len(answer))
            assert applied - set(BENIGN), (code, answer, request)  # a valid request failed

    one()
    assert seen.get("OK", 0) >= 25 and seen.get("INVALID_ARGUMENT", 0) >= 1000, seen
    assert seen.get("RESOURCE_EXHAUSTED", 0) >= 1, seen


@pytest.mark.timeout(600)
def test_wire_level_garbage_is_rejected(fuzz_target):
    server, _, _ = fuzz_target
    channel = server._channel
    since, started = log_size(server), time.monotonic()
    score, info, load = (
        channel.unary_unary(f"/megascore.v1.Scorer/{method}")  # bytes on the wire as given
        for method in ("Score", "GetModelInfo", "LoadWeights")
    )
    seen: dict[str, int] = {}

    @settings(FUZZ, max_examples=600)
    @given(wire_payloads())
    def one(data):
        try:
            request = pb.ScoreRequest.FromString(data)
        except DecodeError:
            request = None
        try:
            answer = score(data, timeout=DEADLINE_S)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code, answer = exc.code(), exc.details()
        seen[code.name] = seen.get(code.name, 0) + 1
        if request is None:
            assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, answer, data)
            assert answer.startswith(UNPARSEABLE + "megascore.v1.ScoreRequest: "), answer
        elif code is grpc.StatusCode.OK:
            check_ok(request, pb.ScoreResponse.FromString(answer))
        else:
            assert code in INVALID, (code, answer, data)

    one()
    assert seen.get("INVALID_ARGUMENT", 0) >= 100, seen
    # GetModelInfo takes an empty message: garbage fails to parse, anything else is fine.
    for method, message in ((info, "GetModelInfoRequest"), (load, "LoadWeightsRequest")):
        for garbage in GARBAGE:
            with pytest.raises(grpc.RpcError) as err:
                method(garbage, timeout=DEADLINE_S)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(f"{UNPARSEABLE}megascore.v1.{message}: ")
    assert pb.ModelInfo.FromString(info(b"", timeout=DEADLINE_S)).vocab_size == VOCAB
    assert_quiet_log(server, since, started)


@pytest.mark.timeout(600)
def test_garbage_stream_messages_end_the_stream_invalid_argument(fuzz_target):
    server, _, probe = fuzz_target
    stream = server._channel.stream_stream("/megascore.v1.Scorer/ScoreStream")  # raw bytes
    since, started = log_size(server), time.monotonic()
    requests = hostile_requests().map(lambda case: case[0].SerializeToString())
    message = st.one_of(requests, st.sampled_from(GARBAGE))

    @settings(FUZZ, max_examples=100)
    @given(st.lists(message, min_size=1, max_size=4).filter(lambda m: set(m) & set(GARBAGE)))
    def one(messages):
        responses = []
        try:
            for response in stream(iter(messages), timeout=DEADLINE_S):
                responses.append(pb.ScoreResponse.FromString(response))
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
        assert code in INVALID, (code, details)
        first_bad = min(i for i, m in enumerate(messages) if m in GARBAGE)
        assert len(responses) <= first_bad
        for raw, response in zip(messages, responses, strict=False):
            check_ok(pb.ScoreRequest.FromString(raw), response)
        if len(responses) == first_bad and details.startswith(UNPARSEABLE):
            assert f"stream message {first_bad}: " in details, details

    one()
    assert_quiet_log(server, since, started)
    assert same_answer(server.stub().Score(PROBE, timeout=DEADLINE_S), probe)


@pytest.mark.timeout(600)
def test_hostile_stream_messages_end_the_stream_with_a_documented_code(fuzz_target):
    server, _, probe = fuzz_target
    stub = server.stub()

    @settings(FUZZ, max_examples=150)
    @given(st.lists(hostile_requests(), min_size=1, max_size=4))
    def one(messages):
        requests = [request for request, _ in messages]
        responses = []
        try:
            for response in stub.ScoreStream(iter(requests), timeout=DEADLINE_S):
                responses.append(response)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
        # in order, one per request, up to the first failure
        for request, response in zip(requests, responses, strict=False):
            check_ok(request, response)
        if code is grpc.StatusCode.OK:
            assert len(responses) == len(requests)
        else:
            assert code in INVALID and len(responses) < len(requests), code

    one()
    assert same_answer(stub.Score(PROBE, timeout=DEADLINE_S), probe)


@pytest.mark.timeout(600)
def test_load_weights_of_unloadable_models_keeps_serving(fuzz_target):
    server, _, probe = fuzz_target
    stub = server.stub()

    @settings(FUZZ, max_examples=40)
    @given(UNLOADABLE_MODELS, st.text(max_size=10))
    def one(model, version):
        request = pb.LoadWeightsRequest(model=model, weights_version=version)
        with pytest.raises(grpc.RpcError) as err:
            stub.LoadWeights(request, timeout=DEADLINE_S)
        code, details = err.value.code(), err.value.details()
        allowed = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
        assert code in allowed, (model, code, details)
        if code is grpc.StatusCode.FAILED_PRECONDITION:
            assert f"still serving weights {WEIGHTS!r}" in details, details

    one()
    assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=DEADLINE_S).weights_version == (
        WEIGHTS
    )
    assert same_answer(stub.Score(PROBE, timeout=DEADLINE_S), probe)

"""MoE routing on the wire: validation, batching and the response, with a fake MoE engine.

The fake engine (tests/service/fake_engine.py) routes token x of layer l to experts
(x + l + j) % E and lets the routes of a token shift the next token's logprob, so a
replayed routing shows in the logprobs; the real engine is tested in
tests/unit/test_routing.py and tests/distributed/test_routing.py.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import grpc
import numpy as np
import pytest

from megascore.api.errors import InvalidRequestError
from megascore.api.limits import Limits, RoutingShape
from megascore.api.wire import decode_array, encode_array
from megascore.v1 import scoring_pb2 as pb
from megascore_server.validation import validate_request
from tests.service.fake_engine import MAX_LEN, MAX_TOP_K, VOCAB, FakeEngine, compute, fake_routing
from tests.service.harness import Req, ServerThread

SHAPE = RoutingShape(num_moe_layers=2, topk=2, num_experts=4)
DENSE = Limits(
    vocab_size=VOCAB,
    max_sequence_length=MAX_LEN,
    max_request_tokens=4000,
    max_top_k=MAX_TOP_K,
    loss_names=("nll",),
)
MOE = dataclasses.replace(DENSE, routing=SHAPE)
SEQS = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]


def request(seqs=SEQS, *, return_routing=False, routing=None, dtype=np.int64, **kw):
    proto = Req(seqs, **kw).proto()
    proto.options.return_routing = return_routing
    if routing is not None:
        proto.routing.CopyFrom(encode_array(np.asarray(routing, dtype=dtype)))
    return proto


def other_routing(seqs=SEQS) -> np.ndarray:
    """Valid routes unlike the fake engine's own: experts (3 - x - l - j) % 4."""
    return (3 - fake_routing(np.concatenate(seqs), SHAPE)) % SHAPE.num_experts


def test_validation_accepts_a_routing_and_returns_it_as_int32():
    routes = other_routing()
    batch = validate_request(request(routing=routes, return_routing=True), MOE)
    assert batch.return_routing and batch.routing.dtype == np.int32
    np.testing.assert_array_equal(batch.routing, routes)


def _bad(routes, seq=None, at=None, value=None):
    routes = routes.copy()
    if seq is not None:
        routes[at] = value
    return routes


@pytest.mark.parametrize(
    ("proto", "limits", "parts"),
    [
        (request(return_routing=True), DENSE, ["options.return_routing", "no MoE layers"]),
        (request(routing=other_routing()), DENSE, ["routing:", "no MoE layers"]),
        (
            request(routing=other_routing()[:-1]),
            MOE,
            ["routing: shape must be", "[9, 2, 2]", "got [32]"],
        ),
        (
            request(routing=_bad(other_routing(), 1, (4, 1, 0), 4)),
            MOE,
            ["routing: sequence 1: expert ids must be in [0, 4)"],
        ),
        (
            request(routing=_bad(other_routing(), 0, (0, 0, 0), -1), dtype=np.int32),
            MOE,
            ["routing: sequence 0: expert ids"],
        ),
        (
            request(routing=_bad(other_routing(), 2, (8, 1), [2, 2])),
            MOE,
            ["routing: sequence 2:", "distinct"],
        ),
        (request(routing=other_routing(), dtype=np.float32), MOE, ["routing", "DTYPE_FLOAT32"]),
    ],
    ids=["return-dense", "replay-dense", "size", "range", "negative", "duplicate", "float"],
)
def test_validation_refuses_bad_routing(proto, limits, parts):
    with pytest.raises(InvalidRequestError) as info:
        validate_request(proto, limits)
    for part in parts:
        assert part in info.value.reason, info.value.reason


def _routing(response: pb.ScoreResponse) -> np.ndarray:
    shape = (-1, response.routing_num_moe_layers, response.routing_topk)
    return decode_array(response.routing, "routing").reshape(shape)


def _expected(seqs, *, routing=None, return_routing=False):
    batch = Req(seqs).batch()
    batch = dataclasses.replace(
        batch,
        routing=None if routing is None else np.asarray(routing, np.int32),
        return_routing=return_routing,
    )
    return compute(batch, "v0", SHAPE)


@pytest.fixture(scope="module")
def moe_server():
    # a small budget spreads the larger requests over several steps
    srv = ServerThread(FakeEngine(routing=SHAPE), max_tokens_per_batch=24, max_batch_wait_ms=20)
    yield srv
    srv.stop()


def test_concurrent_requests_record_and_replay_their_own_routing(moe_server):
    """Recording, replaying and plain requests arrive together: each gets its own
    routes and the logprobs of its own routing; no step mixes replayed and routed tokens."""
    rng = np.random.default_rng(0)
    cases = []
    for i in range(12):
        seqs = [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(1, 12, 3)]
        replay = other_routing(seqs) if i % 3 == 1 else None
        cases.append((seqs, i % 3 != 2, replay))
    stub = moe_server.stub()
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        futures = [
            pool.submit(
                stub.Score,
                request(seqs, return_routing=want, routing=replay, request_id=str(i)),
                timeout=30,
            )
            for i, (seqs, want, replay) in enumerate(cases)
        ]
        responses = [f.result() for f in futures]
    for (seqs, want, replay), response in zip(cases, responses, strict=True):
        expected = _expected(seqs, routing=replay, return_routing=want)
        lps = decode_array(response.token_logprobs, "token_logprobs")
        np.testing.assert_array_equal(lps, expected.logprobs)
        if want:
            np.testing.assert_array_equal(_routing(response), expected.routing)
            assert (response.routing_num_moe_layers, response.routing_topk) == (2, 2)
        else:
            assert not response.HasField("routing") and response.routing_topk == 0
    steps = [batch for batch, _ in moe_server.engine.steps]
    assert any(s.routing is not None for s in steps) and any(s.routing is None for s in steps)
    assert any(len(s.lengths) > 3 for s in steps)  # requests did share steps
    for step in steps:
        assert step.routing is None or step.routing.shape[0] == step.num_tokens


def test_replayed_routing_changes_the_logprobs(moe_server):
    stub = moe_server.stub()
    own = stub.Score(request(return_routing=True), timeout=30)
    replayed = stub.Score(request(routing=_routing(own), return_routing=True), timeout=30)
    other = stub.Score(request(routing=other_routing()), timeout=30)
    lps = [decode_array(r.token_logprobs, "token_logprobs") for r in (own, replayed, other)]
    np.testing.assert_array_equal(lps[1], lps[0])
    np.testing.assert_array_equal(_routing(replayed), _routing(own))
    assert not np.array_equal(lps[2], lps[0])


def test_bad_routing_is_refused_and_the_server_keeps_serving(moe_server):
    stub = moe_server.stub()
    with pytest.raises(grpc.RpcError) as info:
        stub.Score(request(routing=_bad(other_routing(), 1, (3, 0, 1), 9)), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "routing: sequence 1" in info.value.details()
    assert stub.Score(request(return_routing=True), timeout=30).routing_topk == 2


def test_dense_server_refuses_every_moe_only_option():
    """Routing, MoE metrics and MTP metrics alike: INVALID_ARGUMENT naming the option
    on a model without those layers (never a silently empty answer)."""
    srv = ServerThread(FakeEngine(metrics=False))
    moe_metrics, mtp_metrics = request(), request()
    moe_metrics.options.return_moe_metrics = True
    mtp_metrics.options.return_mtp_metrics = True
    try:
        stub = srv.stub()
        for proto, field, layers in (
            (request(return_routing=True), "options.return_routing", "MoE"),
            (request(routing=other_routing()), "routing", "MoE"),
            (moe_metrics, "options.return_moe_metrics", "MoE"),
            (mtp_metrics, "options.return_mtp_metrics", "MTP"),
        ):
            with pytest.raises(grpc.RpcError) as info:
                stub.Score(proto, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f": {field}: the served model has no {layers} layers" in info.value.details()
        assert stub.Score(request(), timeout=30).HasField("token_logprobs")
    finally:
        srv.stop()

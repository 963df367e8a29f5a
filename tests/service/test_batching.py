"""Dynamic batching through a real server: merging, splitting, options, isolation, drops."""

from __future__ import annotations

import concurrent.futures
import dataclasses

import grpc
import numpy as np
import pytest

from megascore.v1 import scoring_pb2 as pb
from tests.service.fake_engine import FakeEngine, compute
from tests.service.harness import (
    Req,
    ServerThread,
    check_response,
    engine_held,
    random_req,
    serving,
    wait_for,
)

BUDGET = 64


@pytest.fixture(scope="module")
def server():
    yield from serving(FakeEngine(), max_tokens_per_batch=BUDGET, max_batch_wait_ms=5)


def new_steps(engine: FakeEngine, since: int):
    return [batch for batch, _ in engine.steps[since:]]


def queued(server, n: int) -> None:
    wait_for(lambda: server.handles.batcher.queue_depth == n, what=f"{n} queued requests")


def test_max_sequence_length_clamped_to_budget(server):
    assert server.handles.limits.max_sequence_length == BUDGET
    assert server.stub().GetModelInfo(pb_info(), timeout=5).max_sequence_length == BUDGET


def pb_info():
    return pb.GetModelInfoRequest()


def test_concurrent_requests_merge_into_one_step(server):
    engine = server.engine
    reqs = [Req([[i + 1] * (3 + i), [i + 2] * 2], request_id=f"m{i}") for i in range(5)]
    stub = server.stub()
    with engine_held(server):
        since = len(engine.steps) + 1  # after the blocker
        futures = [stub.Score.future(r.proto(), timeout=30) for r in reqs]
        queued(server, len(reqs))
    for req, future in zip(reqs, futures, strict=True):
        response = future.result()
        check_response(response, req)
        assert response.timings.num_steps == 1
        assert response.timings.queue_ms > 0
    steps = new_steps(engine, since)
    assert len(steps) == 1 and steps[0].num_sequences == 10


def test_large_request_is_split_and_reassembled(server):
    engine = server.engine
    rng = np.random.default_rng(1)
    lengths = [50, 7, 33, 64, 12, 40, 1, 25, 61, 9]
    req = Req(
        [rng.integers(0, 1000, n).tolist() for n in lengths],
        request_id="big",
        top_k=3,
        losses=("nll", "mean_nll"),
        temperature=0.7,
    )
    since = len(engine.steps)
    response = server.stub().Score(req.proto(), timeout=30)
    check_response(response, req)
    steps = new_steps(engine, since)
    assert response.timings.num_steps == len(steps) >= sum(lengths) // BUDGET + 1
    assert all(step.num_tokens <= BUDGET for step in steps)
    assert sorted(n for step in steps for n in step.lengths.tolist()) == sorted(lengths)


def test_many_concurrent_unary_and_stream_never_mix(server):
    rng = np.random.default_rng(2)
    unary = [random_req(rng, f"u{i}") for i in range(30)]
    streams = [[random_req(rng, f"s{j}-{i}") for i in range(8)] for j in range(3)]
    stub = server.stub()

    def run_stream(reqs):
        return list(stub.ScoreStream(iter([r.proto() for r in reqs]), timeout=60))

    with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
        with engine_held(server):
            futures = [stub.Score.future(r.proto(), timeout=60) for r in unary]
            stream_results = [pool.submit(run_stream, reqs) for reqs in streams]
            queued(server, len(unary) + sum(len(s) for s in streams))
        for req, future in zip(unary, futures, strict=True):
            check_response(future.result(), req)
        for reqs, result in zip(streams, stream_results, strict=True):
            responses = result.result(timeout=60)
            assert [r.request_id for r in responses] == [r.request_id for r in reqs]
            for req, response in zip(reqs, responses, strict=True):
                check_response(response, req)


def test_options_honoured_when_merged(server):
    engine = server.engine
    reqs = [
        Req([[1, 2, 3, 4]], request_id="k0", top_k=0, logprobs=True),
        Req([[1, 2, 3, 4]], request_id="k2", top_k=2, temperature=0.5, losses=("nll",)),
        Req(
            [[1, 2, 3, 4], [5, 6]],
            request_id="k5",
            top_k=5,
            temperature=2.0,
            logprobs=False,
            losses=("mean_nll",),
            mask=[[1, 0, 1, 1], [0, 1]],
        ),
        Req([[9, 8, 7]], request_id="none", logprobs=False),
    ]
    stub = server.stub()
    with engine_held(server):
        since = len(engine.steps) + 1
        futures = [stub.Score.future(r.proto(), timeout=30) for r in reqs]
        queued(server, len(reqs))
    responses = [f.result() for f in futures]
    for req, response in zip(reqs, responses, strict=True):
        check_response(response, req)
    (step,) = new_steps(engine, since)
    assert step.top_k == 5 and set(step.losses) == {"nll", "mean_nll"} and step.return_logprobs
    # Same tokens, other temperatures: different values, each at its own temperature.
    lp = [np.frombuffer(r.token_logprobs.data, "<f4") for r in responses[:2]]
    assert not np.array_equal(lp[0], lp[1])


def test_moe_and_mtp_requests_get_their_own_steps(server):
    engine = server.engine
    rng = np.random.default_rng(3)
    moe = Req([rng.integers(0, 1000, 20).tolist()], request_id="moe", moe=True)
    mtp = Req([rng.integers(0, 1000, 10).tolist()] * 2, request_id="mtp", mtp=True, top_k=1)
    plain = [Req([[i + 1] * 5], request_id=f"p{i}") for i in range(3)]
    stub = server.stub()
    with engine_held(server):
        since = len(engine.steps) + 1
        futures = [stub.Score.future(r.proto(), timeout=30) for r in [moe, mtp, *plain]]
        queued(server, 5)
    responses = [f.result() for f in futures]
    for req, response in zip([moe, mtp, *plain], responses, strict=True):
        check_response(response, req)
    expected_moe = compute(moe.batch()).moe_metrics
    assert dict(responses[0].moe_metrics) == pytest.approx(expected_moe, rel=1e-12)
    expected_mtp = compute(mtp.batch()).mtp_metrics
    assert dict(responses[1].mtp_metrics) == pytest.approx(expected_mtp, rel=1e-12)
    steps = new_steps(engine, since)
    metric_steps = [s for s in steps if s.return_moe_metrics or s.return_mtp_metrics]
    assert len(metric_steps) == 2
    assert {s.num_tokens for s in metric_steps} == {20}  # only their own sequences
    assert len(steps) == 3  # the plain requests shared one step


def test_split_moe_request_reports_token_weighted_mean(server):
    rng = np.random.default_rng(4)
    seqs = [rng.integers(0, 1000, n).tolist() for n in (60, 50, 40, 30)]
    req = Req(seqs, request_id="moe-big", moe=True, mtp=True)
    response = server.stub().Score(req.proto(), timeout=30)
    check_response(response, req)
    assert response.timings.num_steps > 1
    ids = np.concatenate([np.array(s) for s in seqs])
    # The fake's metrics are token means, so the weighted mean over steps is the request mean.
    assert response.moe_metrics["load_balancing_loss"] == pytest.approx(ids.mean() / 1000)
    assert response.mtp_metrics["mtp_1_loss"] == pytest.approx((ids % 17).mean() / 17)


def saw_token(engine: FakeEngine, since: int, token: int) -> bool:
    return any(np.any(b.token_ids == token) for b in new_steps(engine, since))


def test_request_the_engine_refuses_fails_alone_and_the_others_are_rescored(server):
    """A request that passes the wire gate but not the engine's check, merged with good ones:
    only it fails (INVALID_ARGUMENT naming its own sequence); the others get their results."""
    engine = server.engine
    narrow = dataclasses.replace(engine.limits, vocab_size=500)  # the wire gate allows < 1000
    good = [
        Req([[1, 2, 3], [4, 5]], request_id="good0", top_k=2, losses=("nll",)),
        Req([[9, 8, 7, 6]], request_id="good1", temperature=0.5),
    ]
    bad = Req([[11, 12], [13, 700, 14]], request_id="bad", top_k=1)
    stub = server.stub()
    try:
        with engine_held(server):
            engine.limits = narrow
            since = len(engine.steps) + 1  # after the blocker
            refused_before = len(engine.refused)
            futures = [stub.Score.future(r.proto(), timeout=30) for r in (good[0], bad, good[1])]
            queued(server, 3)
        with pytest.raises(grpc.RpcError) as info:
            futures[1].result()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            "token_ids: sequence 1 position 1 has id 700, outside [0, 500)" in info.value.details()
        )
        for req, future in zip(good, (futures[0], futures[2]), strict=True):
            check_response(future.result(), req)
    finally:
        engine.limits = dataclasses.replace(narrow, vocab_size=1000)
    (refused,) = engine.refused[refused_before:]
    assert refused.num_sequences == 5  # all three requests were merged into one step
    (rescored,) = new_steps(engine, since)
    np.testing.assert_array_equal(np.sort(rescored.lengths), [2, 3, 4])  # the good ones only
    assert not saw_token(engine, since, 700)


def test_cancelled_and_expired_requests_are_dropped(server):
    engine = server.engine
    stub = server.stub()
    cancelled = Req([[999] * 10], request_id="cancel-me")
    expired = Req([[998] * 10], request_id="expire-me")
    after = Req([[5, 6, 7]], request_id="after")
    with engine_held(server):
        since = len(engine.steps)
        doomed = stub.Score.future(cancelled.proto(), timeout=30)
        late = stub.Score.future(expired.proto(), timeout=0.3)
        queued(server, 2)
        doomed.cancel()
        with pytest.raises(grpc.RpcError) as info:
            late.result()
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        queued(server, 0)
        ok = stub.Score.future(after.proto(), timeout=30)
        queued(server, 1)
    check_response(ok.result(), after)
    assert doomed.cancelled()
    assert not saw_token(engine, since, 999) and not saw_token(engine, since, 998)
    assert server.handles.metrics.dropped._value.get() >= 2


def test_queue_full_is_resource_exhausted():
    srv = ServerThread(
        FakeEngine(),
        max_queue=2,
        max_queue_tokens=100,
        max_request_tokens=100,
        max_batch_wait_ms=0,
    )
    try:
        stub = srv.stub()
        small = [Req([[1, 2, 3]], request_id=f"q{i}") for i in range(2)]
        big = Req([[4] * 60], request_id="big")
        with engine_held(srv):
            futures = [stub.Score.future(r.proto(), timeout=30) for r in small]
            queued(srv, 2)
            with pytest.raises(grpc.RpcError) as info:
                stub.Score(Req([[1]], request_id="third").proto(), timeout=5)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_queue 2" in info.value.details()
        for req, future in zip(small, futures, strict=True):
            check_response(future.result(), req)
        with engine_held(srv):
            first = stub.Score.future(big.proto(), timeout=30)
            queued(srv, 1)
            with pytest.raises(grpc.RpcError) as info:
                stub.Score(Req([[4] * 60], request_id="big2").proto(), timeout=5)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_queue_tokens 100" in info.value.details()
        check_response(first.result(), big)
    finally:
        srv.stop()


def test_max_batch_wait_collects_then_full_budget_launches_at_once():
    engine = FakeEngine()
    srv = ServerThread(engine, max_tokens_per_batch=BUDGET, max_batch_wait_ms=400)
    try:
        stub = srv.stub()
        first, second = Req([[1, 2, 3]], request_id="w1"), Req([[4, 5]], request_id="w2")
        f1 = stub.Score.future(first.proto(), timeout=30)
        queued(srv, 1)
        f2 = stub.Score.future(second.proto(), timeout=30)
        r1, r2 = f1.result(), f2.result()
        check_response(r1, first)
        check_response(r2, second)
        assert len(engine.steps) == 1 and engine.steps[0][0].num_sequences == 2
        assert r1.timings.queue_ms >= 350  # waited for company
        full = Req([[6] * BUDGET], request_id="full")
        response = stub.Score(full.proto(), timeout=30)
        check_response(response, full)
        assert response.timings.queue_ms < 300  # a full step does not wait
    finally:
        srv.stop()


def test_masked_positions_when_merged_with_a_request_asking_for_all(server):
    """A step holding a request with ``logprob_positions`` masked and one without runs
    every position (the merged option says all); each request still gets its own: the
    masked one its fill outside its loss mask, the same values inside."""
    engine = server.engine
    mask = [[0, 0, 1, 1, 0], [1, 1, 0]]
    whole = Req([[1, 2, 3, 4, 5], [6, 7, 8]], request_id="all", top_k=2, mask=mask)
    masked = dataclasses.replace(whole, request_id="masked")
    request = masked.proto()
    request.options.logprob_positions = pb.LOGPROB_POSITIONS_MASKED
    stub = server.stub()
    with engine_held(server):
        since = len(engine.steps) + 1
        futures = [stub.Score.future(r, timeout=30) for r in (whole.proto(), request)]
        queued(server, 2)
    want, got = (f.result() for f in futures)
    (step,) = new_steps(engine, since)
    assert step.logprob_positions == 0
    inside = np.array([0, 0, 1, 1, 0, 0, 1, 0], bool)  # entry 0 of each sequence never
    for field, dtype, fill in (
        ("token_logprobs", "<f4", 0.0),
        ("top_k_ids", "<i8", -1),
        ("top_k_logprobs", "<f4", 0.0),
    ):
        a = np.frombuffer(getattr(got, field).data, dtype).reshape(8, -1)
        b = np.frombuffer(getattr(want, field).data, dtype).reshape(8, -1)
        np.testing.assert_array_equal(a[inside], b[inside])
        assert (a[~inside] == fill).all() and (b[~inside] != fill).any(), field

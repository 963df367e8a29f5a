"""Automatic splitting of large batches under the message and token limits."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from megascore.api.wire import decode_array, encode_array
from megascore.v1 import scoring_pb2 as pb
from megascore_client import AsyncScoringClient, InvalidInputError, ScoringClient, ScoringError
from megascore_client.inputs import make_batch
from megascore_client.results import ScoreResult
from megascore_client.splitting import (
    ROUTING_VALUES_GUESS,
    ScoreOptions,
    build_parts,
    decode_part,
    merge,
    plan,
)
from tests.client.fake_server import (
    VOCAB,
    FakeScorer,
    FakeServer,
    ref_logprobs,
    ref_moe,
    ref_mtp,
    ref_nll,
    ref_routing,
    ref_top_k,
)

LIMIT = 64 * 1024


def _batch(seed: int, count: int, low: int, high: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, size=int(n)) for n in rng.integers(low, high, size=count)]


@pytest.fixture
def small_server():
    """Server that itself refuses messages over LIMIT: a bad size estimate fails the test."""
    with FakeServer(FakeScorer(), max_message_bytes=LIMIT) as srv:
        yield srv


def test_large_batch_is_split_and_reassembled_in_order(small_server):
    seqs = _batch(0, 300, 10, 200)
    masks = [np.arange(len(s)) % 3 != 0 for s in seqs]
    with ScoringClient(small_server.target, max_message_bytes=LIMIT, max_concurrency=3) as c:
        result = c.score(
            seqs, loss_mask=masks, top_k=4, metrics=("moe", "mtp"), request_id="big", timeout=30
        )
    requests = small_server.scorer.requests
    assert len(requests) == result.timings.num_requests > 5
    assert sorted(r["request_id"] for r in requests) == sorted(
        f"big/{i}" for i in range(len(requests))
    )
    assert all(r["byte_size"] < LIMIT for r in requests)
    assert sum(r["num_sequences"] for r in requests) == 300
    assert result.request_id == "big" and len(result) == 300
    assert result.lengths.tolist() == [len(s) for s in seqs]
    for i, seq in enumerate(seqs):
        np.testing.assert_array_equal(result.logprobs[i], ref_logprobs(seq))
        np.testing.assert_array_equal(result.top_k_ids[i], ref_top_k(seq, 4)[0])
    np.testing.assert_allclose(
        result.loss["nll"], [ref_nll(s, m) for s, m in zip(seqs, masks, strict=True)]
    )
    # Token-weighted mean of per-request means == the mean over the whole batch.
    flat = np.concatenate(seqs)
    assert result.moe_metrics == pytest.approx(ref_moe(flat))
    assert result.mtp_metrics == pytest.approx(ref_mtp(flat))
    assert result.timings.compute_ms == pytest.approx(2.0 * len(requests))


def test_auto_token_limit_from_model_info():
    with FakeServer(FakeScorer(max_request_tokens=500)) as srv:
        seqs = _batch(1, 40, 20, 120)
        with ScoringClient(srv.target) as c:
            first = c.score(seqs)
            second = c.score(seqs[:3])
        assert srv.scorer.calls["GetModelInfo"] == 1
        assert all(r["num_tokens"] <= 500 for r in srv.scorer.requests)
        assert first.timings.num_requests > 1 and second.timings.num_requests == 1
        for got, seq in zip(first.logprobs, seqs, strict=True):
            np.testing.assert_array_equal(got, ref_logprobs(seq))
        with ScoringClient(srv.target, max_request_tokens=None) as c:
            with pytest.raises(ScoringError) as info:
                c.score(seqs)
            assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_default_client_splits_under_the_message_limit_the_server_advertises():
    """ModelInfo.max_message_bytes below the client's 256 MiB: a default client splits
    under it, in both directions (here the requests fit, the top-k responses do not)."""
    scorer = FakeScorer(max_message_bytes=LIMIT)
    seqs = _batch(3, 60, 100, 180)
    (whole,) = build_parts(make_batch(seqs), ScoreOptions(top_k=4), "w", max_message_bytes=1 << 30)
    assert whole.request.ByteSize() < LIMIT < whole.num_tokens * 12 * 4  # responses bind

    async def score_async(target):
        async with AsyncScoringClient(target, timeout=30) as c:
            return await c.score(seqs, top_k=4), c.message_limit

    with FakeServer(scorer, max_message_bytes=LIMIT) as srv:
        with ScoringClient(srv.target, timeout=30) as c:
            assert c.message_limit == 256 * 1024 * 1024  # not known before the lookup
            result = c.score(seqs, top_k=4, request_id="adv")
            assert c.message_limit == LIMIT and c.model_info().max_message_bytes == LIMIT
        sent = len(scorer.requests)
        assert sent == result.timings.num_requests > 1
        assert sorted(r["request_id"] for r in scorer.requests) == [f"adv/{i}" for i in range(sent)]
        for i, seq in enumerate(seqs):
            np.testing.assert_array_equal(result.logprobs[i], ref_logprobs(seq))
            np.testing.assert_array_equal(result.top_k_ids[i], ref_top_k(seq, 4)[0])
        async_result, async_limit = asyncio.run(score_async(srv.target))
        assert async_limit == LIMIT and async_result.timings.num_requests == sent
        np.testing.assert_array_equal(async_result.lengths, result.lengths)
        # A client's own smaller limit still wins over the server's.
        with ScoringClient(srv.target, timeout=30, max_message_bytes=LIMIT) as c:
            c.score(seqs[:2])
            assert c.message_limit == LIMIT
        # Not advertised (0, an older server): the client's limit applies, and the
        # unsplit batch's response is over the server's real limit.
        scorer.max_message_bytes = 0
        with ScoringClient(srv.target, timeout=30) as c:
            with pytest.raises(ScoringError) as info:
                c.score(seqs, top_k=4)
            assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert c.message_limit == 256 * 1024 * 1024


def test_sequence_over_the_limit_is_rejected_locally(small_server):
    with ScoringClient(small_server.target, max_message_bytes=LIMIT) as c:
        with pytest.raises(InvalidInputError) as info:
            c.score([[1, 2], list(range(1, 512)) * 10], top_k=8)
    assert "sequences[1]" in info.value.details and "response bytes" in info.value.details
    assert small_server.scorer.calls["Score"] == 0


def test_plan_ranges_are_consecutive_and_within_limits():
    seqs = _batch(2, 500, 1, 300)
    batch = make_batch(seqs, loss_mask=[np.ones(len(s), dtype=bool) for s in seqs])
    options = ScoreOptions(top_k=2, losses=("nll", "mean_nll"))
    ranges = plan(batch, options, max_message_bytes=LIMIT, max_request_tokens=3000)
    assert ranges[0][0] == 0 and ranges[-1][1] == 500
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    for start, stop in ranges:
        tokens = int(batch.lengths[start:stop].sum())
        assert tokens <= 3000 and tokens * (4 + 12 * 2) < LIMIT
    assert plan(batch, options, max_message_bytes=1 << 30) == [(0, 500)]


@pytest.mark.parametrize("bad", [0, 37, 79])
def test_a_server_error_names_the_sequence_in_the_callers_batch(bad):
    """The server counts sequences within its request; ``ScoringError.sequence_index``
    counts them in the caller's split batch (sync and asyncio)."""
    seqs = _batch(4, 80, 20, 60)
    seqs[bad] = seqs[bad].copy()
    seqs[bad][3] = VOCAB + 5  # the client does not know the vocabulary: the server refuses

    async def score_async(target):
        async with AsyncScoringClient(target, timeout=30) as c:
            await c.score(seqs)

    with FakeServer(FakeScorer(max_request_tokens=400)) as srv:
        with ScoringClient(srv.target, timeout=30, max_concurrency=2) as c:
            with pytest.raises(ScoringError) as info:
                c.score(seqs)
        with pytest.raises(ScoringError) as async_info:
            asyncio.run(score_async(srv.target))
    parts = plan(make_batch(seqs), ScoreOptions(), max_message_bytes=LIMIT, max_request_tokens=400)
    start = next(a for a, b in parts if a <= bad < b)
    for error in (info.value, async_info.value):
        assert error.code is grpc.StatusCode.INVALID_ARGUMENT
        assert f"sequence {bad - start} has id {VOCAB + 5}" in error.details
        assert error.sequence_offset == start and error.sequence_index == bad
    assert bad == 0 or len(parts) > 1 and start > 0


def test_a_response_that_breaks_the_contract_is_internal():
    batch = make_batch([[1, 2, 3], [4, 5]])
    (part,) = build_parts(batch, ScoreOptions(losses=()), "r", max_message_bytes=1 << 20)
    good = pb.ScoreResponse(request_id="r", token_logprobs=encode_array(np.zeros(5, np.float32)))
    assert decode_part(good, part).logprobs[1].tolist() == [0.0, 0.0]
    for array, expected in [
        (encode_array(np.zeros(5, np.float64)), "dtype DTYPE_FLOAT64, expected DTYPE_FLOAT32"),
        (encode_array(np.zeros(4, np.float32)), "16 bytes, expected 5 values (20 bytes)"),
        (pb.Array(dtype=pb.DTYPE_FLOAT32, data=b"\0" * 21), "21 bytes, expected 5 values"),
    ]:
        bad = pb.ScoreResponse(request_id="r", token_logprobs=array)
        with pytest.raises(ScoringError) as info:
            decode_part(bad, part)
        assert info.value.code is grpc.StatusCode.INTERNAL
        assert f"malformed response: token_logprobs has {expected}" in info.value.details


def test_routing_is_split_with_its_sequences_and_rejoined(small_server):
    """The routing to replay travels with its sequences (request bytes count it), the
    returned routing is cut and rejoined per sequence like the logprobs."""
    seqs = _batch(5, 120, 10, 100)
    given = [ref_routing(s) + 1 for s in seqs]  # unlike the fake model's own routes
    with ScoringClient(small_server.target, max_message_bytes=LIMIT, max_concurrency=3) as c:
        own = c.score(seqs[:5], return_routing=True, timeout=30)
        result = c.score(seqs, routing=given, return_routing=True, request_id="re", timeout=30)
    for i, seq in enumerate(seqs[:5]):
        np.testing.assert_array_equal(own.routing[i], ref_routing(seq))
    requests = [r for r in small_server.scorer.requests if r["request_id"].startswith("re/")]
    assert len(requests) == result.timings.num_requests > 1
    assert all(r["byte_size"] < LIMIT for r in requests)
    requests.sort(key=lambda r: int(r["request_id"].split("/")[1]))  # part order
    sent = np.concatenate([r["routing"] for r in requests])
    np.testing.assert_array_equal(sent, np.concatenate(given).reshape(-1))
    for i, seq in enumerate(seqs):
        assert result.routing[i].dtype == np.int32
        np.testing.assert_array_equal(result.routing[i], given[i])
        np.testing.assert_array_equal(result.logprobs[i], ref_logprobs(seq))


def test_plan_counts_routing_bytes():
    seqs = _batch(6, 200, 10, 100)
    batch = make_batch(seqs, routing=[ref_routing(s) for s in seqs])
    assert batch.routing.shape[1:] == (3, 2)  # 6 int32 values per token
    unrouted = plan(make_batch(seqs), ScoreOptions(), max_message_bytes=LIMIT)
    replayed = plan(batch, ScoreOptions(), max_message_bytes=LIMIT)
    assert len(replayed) > len(unrouted)  # 24 more request bytes per token
    for start, stop in replayed:
        assert int(batch.lengths[start:stop].sum()) * (4 + 24) < LIMIT
    asked = plan(make_batch(seqs), ScoreOptions(return_routing=True), max_message_bytes=LIMIT)
    for start, stop in asked:  # shape unknown: ROUTING_VALUES_GUESS per token, for cutting
        tokens = int(batch.lengths[start:stop].sum())
        assert stop == start + 1 or tokens * 4 * (1 + ROUTING_VALUES_GUESS) < LIMIT
    assert any(stop == start + 1 for start, stop in asked)  # alone over the guess: still sent


def test_a_routing_response_that_breaks_the_contract_is_internal():
    (part,) = build_parts(
        make_batch([[1, 2, 3]]),
        ScoreOptions(losses=(), return_logprobs=False, return_routing=True),
        "r",
        max_message_bytes=1 << 20,
    )
    routes = encode_array(np.zeros(3 * 3 * 2, np.int32))
    good = pb.ScoreResponse(request_id="r", routing=routes, routing_num_moe_layers=3)
    good.routing_topk = 2
    assert decode_part(good, part).routing[0].shape == (3, 3, 2)
    for response, expected in [
        (pb.ScoreResponse(request_id="r", routing=routes), "routing shape (3, 0, 0)"),
        (
            pb.ScoreResponse(
                request_id="r",
                routing=encode_array(np.zeros(18, np.int64)),
                routing_num_moe_layers=3,
                routing_topk=2,
            ),
            "routing has dtype DTYPE_INT64, expected DTYPE_INT32",
        ),
    ]:
        with pytest.raises(ScoringError) as info:
            decode_part(response, part)
        assert info.value.code is grpc.StatusCode.INTERNAL and expected in info.value.details


@pytest.mark.parametrize("groups", [False, True])
def test_score_from_travels_with_its_sequences_in_every_part(groups):
    """Each part carries its own sequences' ``score_from`` (one per sequence, prompts
    sent once or not), and a part's request counts its bytes."""
    prompt = list(range(1, 40))
    seqs = [prompt + [100 + i] * (i + 1) for i in range(30)]
    starts = np.arange(30) % 7 + 1
    batch = make_batch(seqs, score_from=starts)
    options = ScoreOptions(losses=("nll",))
    parts = build_parts(
        batch, options, "r", max_message_bytes=LIMIT, max_request_tokens=300, groups=groups
    )
    assert len(parts) > 1
    got = np.concatenate([decode_array(p.request.score_from, "s") for p in parts])
    np.testing.assert_array_equal(got, starts)
    for part in parts:
        assert part.request.HasField("groups") is groups
        assert decode_array(part.request.score_from, "s").size == part.lengths.size
    assert not build_parts(make_batch(seqs), options, "r", max_message_bytes=LIMIT)[
        0
    ].request.HasField("score_from")


def test_a_split_batchs_versions_are_joined_the_reference_with_the_scored():
    parts = [
        ScoreResult("r", np.array([3]), None, weights_version=v, reference_weights_version=ref)
        for v, ref in (("v1", "base-1"), ("v2", "base-1"), ("v2", "base-2"))
    ]
    merged = merge(parts, "r")
    assert (merged.weights_version, merged.reference_weights_version) == ("v1,v2", "base-1,base-2")
    plain = merge([ScoreResult("r", np.array([3]), None, weights_version="v1")] * 2, "r")
    assert (plain.weights_version, plain.reference_weights_version) == ("v1", "")

"""``score_from`` and ``cached_tokens`` through the SDK and the wire, on the shared
``--nproc 1`` server (``megascore serve --model tiny``, CPU).

* the per-token outputs before each sequence's ``score_from`` hold their fill, those
  from it on equal the same request without it bit for bit, and the losses,
  ``num_tokens`` and the mismatch statistics are numpy's over the entries from it on;
* a batch the SDK splits keeps each sequence's ``score_from`` with it;
* a bad ``score_from`` is INVALID_ARGUMENT naming the field and the sequence, from the
  SDK's own check and from the server's (raw requests), and the server keeps serving;
* ``cached_tokens`` comes back, one per sequence (0: the engine read nothing from its
  prefix cache for these requests), in the raw response and in the SDK's result.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from megascore.api.wire import decode_array, encode_array
from megascore.v1 import scoring_pb2 as pb
from megascore.v1 import scoring_pb2_grpc as pb_grpc
from megascore_client import InvalidInputError, ScoringClient
from testkit.reference import VOCAB
from tests.mismatch_reference import numpy_mismatch_stats

LENGTHS = (12, 7, 20, 1, 9)
SCORE_FROM = (0, 3, 11, 1, 9)  # the whole sequence, some, most, none of one token, none
TIMEOUT_S = 120.0


def _batch(seed: int = 3):
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, VOCAB, n).tolist() for n in LENGTHS]
    masks = [(rng.random(n) < 0.8).astype(np.uint8).tolist() for n in LENGTHS]
    rollout = [(-rng.random(n) * 5).tolist() for n in LENGTHS]
    return seqs, masks, rollout


OPTIONS = dict(
    top_k=3,
    losses=("nll", "mean_nll"),
    return_entropy=True,
    return_token_ranks=True,
    return_importance_weights=True,
)
PER_TOKEN = {  # ScoreResult attribute -> its fill
    "logprobs": 0.0,
    "top_k_ids": -1,
    "top_k_logprobs": 0.0,
    "entropy": 0.0,
    "token_ranks": 0,
    "importance_weights": 0.0,
}


@pytest.fixture(scope="module")
def scored(shared_tp1):
    """The batch scored without and with ``score_from`` (and with one int for all)."""
    seqs, masks, rollout = _batch()
    with ScoringClient(shared_tp1.target, timeout=TIMEOUT_S) as client:
        args = dict(loss_mask=masks, rollout_logprobs=rollout, **OPTIONS)
        full = client.score(seqs, **args)
        part = client.score(seqs, score_from=list(SCORE_FROM), **args)
        one = client.score(seqs, score_from=1, **args)
    return seqs, masks, rollout, full, part, one


def test_outputs_before_score_from_are_the_fill_and_equal_after_it(tp1, scored):
    seqs, _, _, full, part, _ = scored
    for name, fill in PER_TOKEN.items():
        for i, start in enumerate(SCORE_FROM):
            got, want = getattr(part, name)[i], getattr(full, name)[i]
            assert got.shape == want.shape and got.dtype == want.dtype, name
            assert (got[:start] == fill).all(), (name, i, got[:start])
            np.testing.assert_array_equal(got[start:], want[start:], err_msg=f"{name}[{i}]")
    np.testing.assert_array_equal(part.lengths, [len(s) for s in seqs])


def test_losses_and_mismatch_count_from_score_from(tp1, scored):
    seqs, masks, rollout, full, part, _ = scored
    lengths = np.array(LENGTHS)
    scored_mask = np.concatenate(
        [
            np.where(np.arange(n) >= s, m, 0)
            for n, s, m in zip(LENGTHS, SCORE_FROM, masks, strict=True)
        ]
    ).astype(np.uint8)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    counted = scored_mask.copy()
    counted[starts] = 0  # entry 0 of a sequence has no prediction
    logprobs = np.concatenate(full.logprobs).astype(np.float64)
    nll = -np.add.reduceat(counted * logprobs, starts)
    count = np.add.reduceat(counted, starts).astype(np.int64)
    np.testing.assert_array_equal(part.num_tokens, count)
    np.testing.assert_allclose(part.loss["nll"], nll, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(part.loss["mean_nll"], nll / np.maximum(count, 1), rtol=1e-6)
    assert (part.loss["nll"] != full.loss["nll"]).any()  # it did cut something
    want = numpy_mismatch_stats(
        np.concatenate(full.logprobs), np.concatenate(rollout), lengths, scored_mask, 2.0
    )
    for name, values in want.items():
        np.testing.assert_allclose(part.mismatch_stats[name], values, rtol=1e-6, atol=1e-6)


def test_one_int_applies_to_every_sequence(tp1, scored):
    *_, full, _, one = scored
    for i in range(len(LENGTHS)):
        np.testing.assert_array_equal(one.logprobs[i], full.logprobs[i])  # entry 0 is 0.0 anyway
        np.testing.assert_array_equal(one.top_k_ids[i][1:], full.top_k_ids[i][1:])
    np.testing.assert_array_equal(one.num_tokens, full.num_tokens)


def test_cached_tokens_come_back_per_sequence(tp1, scored):
    *_, full, part, _ = scored
    for result in (full, part):
        assert result.cached_tokens.dtype == np.int64
        np.testing.assert_array_equal(result.cached_tokens, np.zeros(len(LENGTHS), np.int64))


def test_a_split_batch_keeps_each_sequence_score_from(tp1):
    rng = np.random.default_rng(11)
    lengths = rng.integers(2, 15, 17)
    seqs = [rng.integers(0, VOCAB, n).tolist() for n in lengths]
    starts = [int(rng.integers(0, n + 1)) for n in lengths]
    with ScoringClient(tp1.target, timeout=TIMEOUT_S, max_request_tokens=40) as split:
        got = split.score(seqs, score_from=starts, top_k=2)
    with ScoringClient(tp1.target, timeout=TIMEOUT_S, max_request_tokens=None) as whole:
        want = whole.score(seqs, score_from=starts, top_k=2)
        full = whole.score(seqs, top_k=2)
    assert got.timings.num_requests > 1 and want.timings.num_requests == 1
    np.testing.assert_array_equal(got.num_tokens, want.num_tokens)
    np.testing.assert_array_equal(got.loss["nll"], want.loss["nll"])
    np.testing.assert_array_equal(got.cached_tokens, np.zeros(len(seqs), np.int64))
    for i, start in enumerate(starts):
        np.testing.assert_array_equal(got.logprobs[i], want.logprobs[i])
        np.testing.assert_array_equal(got.top_k_ids[i], want.top_k_ids[i])
        assert (got.logprobs[i][:start] == 0).all() and (got.top_k_ids[i][:start] == -1).all()
        np.testing.assert_array_equal(got.logprobs[i][start:], full.logprobs[i][start:])


@pytest.mark.parametrize(
    "value,seq,words",
    [
        ([0, -1, 0], 1, "outside [0, 4]"),
        ([0, 0, 6], 2, "outside [0, 5]"),
        ([0, 1.5, 0], 1, "not an integer"),
        (np.array([0.0, 2.0, 2.5]), 2, "not an integer"),
    ],
)
def test_the_sdk_refuses_a_bad_score_from_naming_the_sequence(tp1, value, seq, words):
    with ScoringClient(tp1.target, timeout=TIMEOUT_S) as client:
        with pytest.raises(InvalidInputError) as err:
            client.score([[1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12]], score_from=value)
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "score_from" in err.value.details and words in err.value.details
    assert err.value.sequence_index == seq


def _raw(score_from: pb.Array | None) -> pb.ScoreRequest:
    request = pb.ScoreRequest(
        request_id="raw",
        token_ids=encode_array(np.array([1, 2, 3, 4, 5, 6, 7], np.int64)),
        lengths=encode_array(np.array([3, 4], np.int64)),
        options=pb.ScoreOptions(return_logprobs=True, losses=["nll"]),
    )
    if score_from is not None:
        request.score_from.CopyFrom(score_from)
    return request


@pytest.mark.parametrize(
    "values,words",
    [
        (np.array([0, -2], np.int64), ("score_from", "sequence 1", "-2")),
        (np.array([4, 0], np.int32), ("score_from", "sequence 0", "outside [0, 3]")),
        (np.array([1], np.int64), ("score_from", "one per sequence")),
        (np.array([0.0, 1.5]), ("score_from", "FLOAT64")),
    ],
)
def test_the_server_refuses_a_bad_score_from_and_keeps_serving(tp1, values, words):
    with grpc.insecure_channel(tp1.target) as channel:
        stub = pb_grpc.ScorerStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(_raw(encode_array(values)), timeout=TIMEOUT_S)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        for word in words:
            assert word in err.value.details(), (word, err.value.details())
        good = stub.Score(_raw(encode_array(np.array([1, 4], np.int64))), timeout=TIMEOUT_S)
    logprobs = decode_array(good.token_logprobs, "token_logprobs")
    assert (logprobs[:1] == 0).all() and (logprobs[3:] == 0).all()  # sequence 1: nothing left
    assert (logprobs[1:3] < 0).all()
    np.testing.assert_array_equal(decode_array(good.num_loss_tokens, "n"), [2, 0])
    assert good.HasField("cached_tokens")
    np.testing.assert_array_equal(decode_array(good.cached_tokens, "c"), [0, 0])

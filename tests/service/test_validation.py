"""Request validation: every malformed case -> status code + message naming field / index.

The same cases run twice: against ``validate_request`` directly (exception type
and message) and through a real server (status code and details), where the
next valid request must still succeed.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from megascore.api.errors import InvalidRequestError, ResourceExhaustedError
from megascore.api.limits import Limits
from megascore.api.wire import encode_array
from megascore.v1 import scoring_pb2 as pb
from megascore_server.validation import validate_request
from tests.service.fake_engine import MAX_LEN, MAX_TOP_K, VOCAB, FakeEngine
from tests.service.harness import Req, check_response, serving

MAX_REQUEST_TOKENS = 2000
LIMITS = Limits(
    vocab_size=VOCAB,
    max_sequence_length=MAX_LEN,
    max_request_tokens=MAX_REQUEST_TOKENS,
    max_top_k=MAX_TOP_K,
    loss_names=("nll", "mean_nll"),
)
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def valid() -> pb.ScoreRequest:
    return Req([[1, 2, 3], [4, 5, 6, 7], [8, 9]], request_id="ok").proto()


def with_ids(ids, lengths=None, dtype=np.int64) -> pb.ScoreRequest:
    request = valid()
    request.token_ids.CopyFrom(encode_array(np.asarray(ids, dtype=dtype)))
    if lengths is not None:
        request.lengths.CopyFrom(encode_array(np.asarray(lengths, dtype=np.int64)))
    return request


def with_lengths(lengths) -> pb.ScoreRequest:
    request = valid()
    request.lengths.CopyFrom(encode_array(np.asarray(lengths, dtype=np.int64)))
    return request


def with_mask(mask, dtype=np.uint8) -> pb.ScoreRequest:
    request = valid()
    request.loss_mask.CopyFrom(encode_array(np.asarray(mask, dtype=dtype)))
    return request


def with_options(**kw) -> pb.ScoreRequest:
    request = valid()
    for key, value in kw.items():
        if key == "losses":
            request.options.losses[:] = value
        else:
            setattr(request.options, key, value)
    return request


def with_raw(field: str, dtype: int, data: bytes) -> pb.ScoreRequest:
    request = valid()
    getattr(request, field).CopyFrom(pb.Array(dtype=dtype, data=data))
    return request


def without(field: str) -> pb.ScoreRequest:
    request = valid()
    request.ClearField(field)
    return request


GROUPED = [[1, 2, 3], [1, 2, 4, 5], [8, 9]]  # groups: the prompt [1, 2] twice, then [8, 9]


def grouped(sizes=(2, 1), prompts=(2, 0), ids=(1, 2, 3, 4, 5, 8, 9), dtype=np.int64):
    """A request of :data:`GROUPED` sent with ``ScoreRequest.groups`` (ids on the wire)."""
    request = Req(GROUPED, request_id="ok").proto()
    request.token_ids.CopyFrom(encode_array(np.asarray(ids, dtype=np.int64)))
    if sizes is not None:
        request.groups.sizes.CopyFrom(encode_array(np.asarray(sizes, dtype=dtype)))
    request.groups.prompt_lengths.CopyFrom(encode_array(np.asarray(prompts, dtype=np.int64)))
    return request


def grouped_with(field: str, values) -> pb.ScoreRequest:
    request = grouped()
    getattr(request, field).CopyFrom(encode_array(np.asarray(values)))
    return request


# (case id, request, status code, substrings the message must contain)
CASES = [
    ("empty-batch", with_ids([], []), INVALID, ["lengths", "empty batch"]),
    ("sum-mismatch", with_lengths([3, 4, 3]), INVALID, ["token_ids", "9 ids", "sum to 10"]),
    ("zero-length", with_ids(range(7), [3, 4, 0]), INVALID, ["lengths", "sequence 2", "length 0"]),
    ("negative-length", with_lengths([3, -4, 2]), INVALID, ["lengths", "sequence 1", "-4"]),
    (
        "id-negative",
        with_ids([1, 2, 3, 4, 5, -1, 7, 8, 9]),
        INVALID,
        ["token_ids", "sequence 1 position 2", "-1"],
    ),
    (
        "id-too-large",
        with_ids([1, 2, 3, 4, 5, 6, 7, 8, VOCAB]),
        INVALID,
        ["token_ids", "sequence 2 position 1", str(VOCAB)],
    ),
    (
        "id-too-large-int32",
        with_ids([VOCAB + 5, 2, 3, 4, 5, 6, 7, 8, 9], dtype=np.int32),
        INVALID,
        ["token_ids", "sequence 0 position 0"],
    ),
    (
        "too-long",
        with_ids(np.zeros(MAX_LEN + 4, dtype=np.int64), [3, MAX_LEN + 1]),
        INVALID,
        ["lengths", "sequence 1", f"max_sequence_length {MAX_LEN}"],
    ),
    (
        "request-too-many-tokens",
        with_ids(np.zeros(5 * 500, dtype=np.int64), [500] * 5),
        EXHAUSTED,
        ["2500 tokens", f"max_request_tokens {MAX_REQUEST_TOKENS}"],
    ),
    ("mask-length", with_mask([1] * 8), INVALID, ["loss_mask", "8 entries", "expected 9"]),
    (
        "mask-value",
        with_mask([1, 1, 1, 0, 2, 1, 1, 1, 1]),
        INVALID,
        ["loss_mask", "sequence 1 position 1", "0 or 1"],
    ),
    (
        "mask-value-int64",
        with_mask([1, 1, 1, 1, 1, 1, 1, 1, -1], dtype=np.int64),
        INVALID,
        ["loss_mask", "sequence 2 position 1"],
    ),
    ("top-k-negative", with_options(top_k=-1), INVALID, ["options.top_k", "-1"]),
    (
        "logprob-positions-unknown",
        with_options(logprob_positions=7),
        INVALID,
        ["options.logprob_positions", "7 is not a LogprobPositions value"],
    ),
    ("top-k-too-large", with_options(top_k=MAX_TOP_K + 1), INVALID, ["options.top_k", "9"]),
    ("temperature-zero", with_options(temperature=0.0), INVALID, ["options.temperature"]),
    ("temperature-negative", with_options(temperature=-1.0), INVALID, ["options.temperature"]),
    ("temperature-nan", with_options(temperature=float("nan")), INVALID, ["options.temperature"]),
    ("temperature-inf", with_options(temperature=float("inf")), INVALID, ["options.temperature"]),
    ("temperature-tiny", with_options(temperature=1e-60), INVALID, ["options.temperature"]),
    (
        "unknown-loss",
        with_options(losses=["nll", "bogus"]),
        INVALID,
        ["options.losses[1]", "'bogus'", "mean_nll, nll"],
    ),
    (
        "ids-float-dtype",
        with_raw("token_ids", pb.DTYPE_FLOAT32, b"\0" * 36),
        INVALID,
        ["token_ids", "DTYPE_FLOAT32"],
    ),
    (
        "ids-unspecified-dtype",
        with_raw("token_ids", pb.DTYPE_UNSPECIFIED, b"\0" * 72),
        INVALID,
        ["token_ids", "DTYPE_UNSPECIFIED"],
    ),
    (
        "ids-byte-length",
        with_raw("token_ids", pb.DTYPE_INT64, b"\0" * 71),
        INVALID,
        ["token_ids", "byte length 71"],
    ),
    (
        "lengths-uint8-dtype",
        with_raw("lengths", pb.DTYPE_UINT8, bytes([3, 4, 2])),
        INVALID,
        ["lengths", "DTYPE_UINT8"],
    ),
    (
        "mask-float-dtype",
        with_raw("loss_mask", pb.DTYPE_FLOAT64, b"\0" * 72),
        INVALID,
        ["loss_mask", "DTYPE_FLOAT64"],
    ),
    (
        "mask-byte-length",
        with_raw("loss_mask", pb.DTYPE_INT32, b"\0" * 35),
        INVALID,
        ["loss_mask", "byte length 35"],
    ),
    ("missing-token-ids", without("token_ids"), INVALID, ["token_ids", "not set"]),
    (
        "groups-sizes-sum",
        grouped(sizes=(2, 2), prompts=(2, 0)),
        INVALID,
        ["groups.sizes", "4 sequences", "lengths has 3"],
    ),
    (
        "groups-sizes-wrap-around",  # 4 x 2**62 + 3 wraps to 3 in int64
        grouped(sizes=(2**62, 2**62, 2**62, 2**62, 3), prompts=(0, 0, 0, 0, 0)),
        INVALID,
        ["groups.sizes", f"group 0 has {2**62} sequences", "lengths has 3"],
    ),
    (
        "groups-empty-group",
        grouped(sizes=(3, 0), prompts=(0, 0)),
        INVALID,
        ["groups.sizes", "group 1 has 0 sequences"],
    ),
    (
        "groups-prompt-count",
        grouped(prompts=(2,)),
        INVALID,
        ["groups.prompt_lengths", "1 entries for 2 groups"],
    ),
    (
        "groups-prompt-negative",
        grouped(prompts=(2, -1)),
        INVALID,
        ["groups.prompt_lengths", "group 1", "-1"],
    ),
    (
        "groups-prompt-longer-than-sequence",
        grouped(sizes=(1, 2), prompts=(0, 3)),
        INVALID,
        ["groups.prompt_lengths", "group 1's prompt has 3 tokens", "sequence 2 (length 2)"],
    ),
    ("groups-sizes-missing", grouped(sizes=None), INVALID, ["groups.sizes", "not set"]),
    (
        "groups-sizes-float",
        grouped(dtype=np.float32),
        INVALID,
        ["groups.sizes", "DTYPE_FLOAT32"],
    ),
    (
        "groups-ids-count",
        grouped(ids=range(1, 10)),
        INVALID,
        ["token_ids", "9 values", "7 tokens sent"],
    ),
    (
        "groups-mask-full-layout",
        grouped_with("loss_mask", np.ones(9, np.uint8)),
        INVALID,
        ["loss_mask", "9 values", "7 tokens sent"],
    ),
    (
        "groups-id-named-in-the-full-layout",
        grouped(ids=(1, 2, 3, 4, VOCAB, 8, 9)),
        INVALID,
        ["token_ids", "sequence 1 position 3", str(VOCAB)],
    ),
    ("missing-lengths", without("lengths"), INVALID, ["lengths", "not set"]),
]
IDS = [case[0] for case in CASES]
_ERRORS = {INVALID: InvalidRequestError, EXHAUSTED: ResourceExhaustedError}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_validate_request_rejects(case):
    _, request, code, parts = case
    with pytest.raises(_ERRORS[code]) as info:
        validate_request(request, LIMITS)
    for part in parts:
        assert part in info.value.reason


def test_validate_request_accepts_and_converts():
    request = with_mask([1, 0, 1, 1, 1, 0, 1, 1, 1], dtype=np.int32)
    request.token_ids.CopyFrom(encode_array(np.arange(9, dtype=np.int32)))
    request.options.temperature = 0.5
    request.options.top_k = 3
    request.options.losses[:] = ["nll", "nll", "mean_nll"]
    batch = validate_request(request, LIMITS)
    assert batch.token_ids.dtype == np.int64 and batch.lengths.dtype == np.int64
    np.testing.assert_array_equal(batch.token_ids, np.arange(9))
    np.testing.assert_array_equal(batch.lengths, [3, 4, 2])
    assert batch.loss_mask.dtype == np.uint8
    np.testing.assert_array_equal(batch.temperature, np.full(3, 0.5, dtype=np.float32))
    assert batch.top_k == 3 and batch.losses == ("nll", "mean_nll")  # deduplicated, in order
    assert batch.return_logprobs and not batch.return_moe_metrics


def test_grouped_request_validates_to_the_request_without_groups():
    """Every per-token array is expanded: the batch equals the one of the same request
    sent whole."""
    whole = Req(GROUPED, request_id="ok", top_k=2).proto()
    mask = np.array([0, 0, 1, 0, 0, 1, 1, 0, 1], np.uint8)
    rollout = -np.arange(1, 10, dtype=np.float64) / 10
    rollout[3:5] = rollout[0:2]  # the shared prompt's rows (a group sends them once)
    whole.loss_mask.CopyFrom(encode_array(mask))
    whole.rollout_logprobs.CopyFrom(encode_array(rollout))
    request = grouped()
    request.options.CopyFrom(whole.options)
    wire = np.array([True, True, True, False, False, True, True, True, True])
    request.loss_mask.CopyFrom(encode_array(mask[wire]))
    request.rollout_logprobs.CopyFrom(encode_array(rollout[wire]))
    got, want = validate_request(request, LIMITS), validate_request(whole, LIMITS)
    for name in ("token_ids", "lengths", "loss_mask", "rollout_logprobs", "temperature"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    assert got.top_k == want.top_k == 2


def test_validate_million_tokens_is_vectorised():
    rng = np.random.default_rng(0)
    lengths = np.full(100_000, 10, dtype=np.int64)
    ids = rng.integers(0, VOCAB, 1_000_000)
    ids[-1] = VOCAB  # the very last token is bad: every check scans everything
    request = pb.ScoreRequest(token_ids=encode_array(ids), lengths=encode_array(lengths))
    request.loss_mask.CopyFrom(encode_array(np.ones(ids.size, dtype=np.uint8)))
    limits = Limits(VOCAB, 16, 8, (), max_request_tokens=2_000_000)
    start = time.perf_counter()
    with pytest.raises(InvalidRequestError, match="sequence 99999 position 9"):
        validate_request(request, limits)
    assert time.perf_counter() - start < 1.0


@pytest.fixture(scope="module")
def server():
    yield from serving(FakeEngine(), max_request_tokens=MAX_REQUEST_TOKENS, max_batch_wait_ms=0)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_server_rejects_then_serves(server, case):
    _, request, code, parts = case
    stub = server.stub()
    request.request_id = "bad-1"
    with pytest.raises(grpc.RpcError) as info:
        stub.Score(request, timeout=10)
    assert info.value.code() == code
    assert "request_id=bad-1" in info.value.details()
    for part in parts:
        assert part in info.value.details()
    good = Req([[1, 2, 3], [4, 5, 6, 7], [8, 9]], request_id="ok", top_k=2, losses=("nll",))
    check_response(stub.Score(good.proto(), timeout=10), good)

"""Hostile input, shared by ``tests/reliability/test_hostile.py`` and ``scripts/fuzz.py``.

Hypothesis strategies for mutated ScoreRequests, wire-level garbage and unloadable
models; the checks an answer must pass; the probe request whose answer must not change.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
from hypothesis import strategies as st

from megascore.api.wire import decode_array
from megascore.config import EngineConfig
from megascore.v1 import scoring_pb2 as pb
from megascore_server.status import DECODE_LOG_EVERY_S
from megascore_server.validation import MAX_ID_CHARS
from testkit.reference import VOCAB, WEIGHTS

DEADLINE_S = 60
MAX_TOP_K = EngineConfig().max_top_k  # the fuzzed server's default
INVALID = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
UNPARSEABLE = "request does not parse as "
GARBAGE = (b"\xff\xff\xff", b"`", b"\xb9", b"\x0a\x05ab")  # none parses as a request
NP_OF = {
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT64: np.dtype("<f8"),
    pb.DTYPE_UINT8: np.dtype("u1"),
}
INT_TAGS = [pb.DTYPE_INT32, pb.DTYPE_INT64]
ANY_TAG = st.sampled_from([0, 1, 2, 3, 4, 5, 6, 99, -1, 2**31 - 1])

# Mutations that make a request invalid for sure (when no ambiguous one is applied too),
# and those whose outcome depends on the bytes (any documented answer is fine).
CERTAIN = (
    "id_out_of_range",
    "ids_as_float",
    "missing_ids",
    "missing_lengths",
    "empty_lengths",
    "bad_length",
    "length_mismatch",
    "too_many_tokens",
    "bad_mask",
    "bad_top_k",
    "bad_temperature",
    "unknown_loss",
    "huge_string",
    "metrics",  # the fuzzed server serves the dense tiny: MoE / MTP metrics are refused
)
AMBIGUOUS = ("retag", "truncate", "random_bytes")
BENIGN = ("odd_request_id", "dup_losses")


def arr(values, tag: int) -> pb.Array:
    return pb.Array(dtype=tag, data=np.asarray(values).astype(NP_OF[tag]).tobytes())


# Strategies are built once: building them inside the composite costs more than the RPC.
S_LENGTHS = st.lists(st.integers(1, 16), min_size=1, max_size=3)
S_SEED = st.integers(0, 2**32 - 1)
S_ID = st.text(max_size=12)
S_INT_TAG = st.sampled_from(INT_TAGS)
S_MASK_TAG = st.sampled_from([pb.DTYPE_UINT8, *INT_TAGS])
S_TOP_K = st.integers(0, 8)
S_LOSSES = st.lists(st.sampled_from(["nll", "mean_nll"]), max_size=2)
S_TEMPERATURE = st.none() | st.floats(0.05, 20.0)
S_PERCENT = st.integers(0, 99)
S_HARMFUL = st.lists(st.sampled_from(CERTAIN + AMBIGUOUS), min_size=1, max_size=2)
S_BENIGN = st.lists(st.sampled_from(BENIGN), max_size=2)
S_BAD_ID = st.sampled_from([VOCAB, VOCAB + 1, 2**31 - 1, -1, -(2**31)])
S_FLOAT_TAG = st.sampled_from([pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT64])
S_BAD_LENGTH = st.sampled_from([0, -1, -(2**31), 1025, 2**31 - 1])
S_MASK_FAULT = st.sampled_from(["value 2", "value 255", "value -1", "short", "long", "empty"])
S_BAD_TOP_K = st.sampled_from([-1, -(2**31), MAX_TOP_K + 1, 10**6, 2**31 - 1])
S_BAD_TEMPERATURE = st.sampled_from(
    [float("nan"), float("inf"), -float("inf"), 0.0, -1.0, -0.0, 1e-300, 1e-40, 1e300]
)
S_UNKNOWN_LOSS = st.text(max_size=8).filter(lambda s: s not in ("nll", "mean_nll"))
S_FIELD = st.sampled_from(["token_ids", "lengths", "loss_mask"])
S_BYTES = st.binary(max_size=64)
S_LONG_ID = st.text(min_size=1, max_size=MAX_ID_CHARS)
S_HUGE_LENGTH = st.sampled_from([MAX_ID_CHARS + 1, 1000, 20_000])


@st.composite
def hostile_requests(draw) -> tuple[pb.ScoreRequest, set[str]]:
    """A ScoreRequest and the names of the mutations applied to its valid base.

    About one request in twenty stays valid (and is scored by the engine); the others
    carry 1-2 harmful mutations and are mostly rejected by validation, which keeps the fuzzer
    fast. Token ids, masks and positions come from a drawn numpy seed (cheap).
    """
    lengths = draw(S_LENGTHS)
    total = sum(lengths)
    rng = np.random.default_rng(draw(S_SEED))
    ids = rng.integers(0, VOCAB, total)
    request = pb.ScoreRequest(
        request_id=draw(S_ID),
        token_ids=arr(ids, draw(S_INT_TAG)),
        lengths=arr(lengths, draw(S_INT_TAG)),
    )
    if rng.random() < 0.5:
        request.loss_mask.CopyFrom(arr(rng.integers(0, 2, total), draw(S_MASK_TAG)))
    options = request.options
    options.return_logprobs = bool(rng.random() < 0.8)
    options.top_k = draw(S_TOP_K)
    options.losses.extend(draw(S_LOSSES))
    temperature = draw(S_TEMPERATURE)
    if temperature is not None:
        options.temperature = temperature

    applied = set(draw(S_BENIGN))
    if draw(S_PERCENT) < 95:  # hypothesis favours small integers: ~5 % stay valid
        applied |= set(draw(S_HARMFUL))
    for name in sorted(applied):
        _mutate(draw, rng, request, name, ids, lengths)
    return request, applied


def _mutate(draw, rng, request: pb.ScoreRequest, name: str, ids, lengths: list[int]) -> None:
    options = request.options
    total = sum(lengths)
    if name == "id_out_of_range":
        bad = ids.copy()
        bad[rng.integers(0, total)] = draw(S_BAD_ID)
        request.token_ids.CopyFrom(arr(bad, draw(S_INT_TAG)))
    elif name == "ids_as_float":
        request.token_ids.CopyFrom(arr(ids, draw(S_FLOAT_TAG)))
    elif name == "missing_ids":
        request.ClearField("token_ids")
    elif name == "missing_lengths":
        request.ClearField("lengths")
    elif name == "empty_lengths":
        request.lengths.CopyFrom(pb.Array(dtype=pb.DTYPE_INT64, data=b""))
    elif name == "bad_length":
        bad = list(lengths)
        bad[rng.integers(0, len(bad))] = draw(S_BAD_LENGTH)
        request.lengths.CopyFrom(arr(bad, draw(S_INT_TAG)))
    elif name == "length_mismatch":
        bad = list(lengths) + ([1] if rng.random() < 0.5 else [])
        bad[0] += 1
        request.lengths.CopyFrom(arr(bad, pb.DTYPE_INT64))
    elif name == "too_many_tokens":  # more than max_request_tokens (1 << 20)
        request.lengths.CopyFrom(arr([1024] * 1100, pb.DTYPE_INT64))
    elif name == "bad_mask":
        fault = draw(S_MASK_FAULT)
        if fault.startswith("value"):
            mask = np.ones(total, dtype=np.int64)
            mask[rng.integers(0, total)] = int(fault.split()[1])
            request.loss_mask.CopyFrom(arr(mask, pb.DTYPE_INT32))
        else:
            size = {"short": total - 1, "long": total + 1, "empty": 0}[fault]
            request.loss_mask.CopyFrom(arr(np.ones(size), pb.DTYPE_UINT8))
    elif name == "bad_top_k":
        options.top_k = draw(S_BAD_TOP_K)
    elif name == "bad_temperature":
        options.temperature = draw(S_BAD_TEMPERATURE)
    elif name == "unknown_loss":
        options.losses.append(draw(S_UNKNOWN_LOSS))
    elif name in AMBIGUOUS:
        array = getattr(request, draw(S_FIELD))
        if name == "retag":
            array.dtype = draw(ANY_TAG)
        elif name == "truncate":
            array.data = array.data[: int(rng.integers(0, max(1, len(array.data))))]
        else:
            array.data = draw(S_BYTES)
    elif name == "metrics":
        options.return_moe_metrics = bool(rng.random() < 0.5)
        options.return_mtp_metrics = True
    elif name == "odd_request_id":
        request.request_id = draw(S_LONG_ID)
    elif name == "dup_losses":
        options.losses.extend(["nll", "nll", "mean_nll"])
    elif name == "huge_string":  # a huge unknown loss, and maybe a request id over the limit
        options.losses.append("L" * draw(S_HUGE_LENGTH))
        if rng.random() < 0.5:
            request.request_id = "R" * draw(S_HUGE_LENGTH)


def check_ok(request: pb.ScoreRequest, response: pb.ScoreResponse) -> None:
    """A successful answer has the request's layout and plausible values."""
    lengths = decode_array(request.lengths, "lengths").astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    total, count = int(offsets[-1]), lengths.size
    options = request.options
    assert response.request_id == request.request_id
    np.testing.assert_array_equal(decode_array(response.lengths, "lengths"), lengths)
    if options.return_logprobs:
        lp = decode_array(response.token_logprobs, "token_logprobs")
        assert lp.dtype == np.float32 and lp.shape == (total,)
        assert np.isfinite(lp).all() and (lp <= 0).all() and (lp[offsets[:-1]] == 0).all()
    else:
        assert not response.HasField("token_logprobs")
    k = options.top_k
    assert response.top_k == k
    if k:
        top_ids = decode_array(response.top_k_ids, "top_k_ids").reshape(total, k)
        top_lps = decode_array(response.top_k_logprobs, "top_k_logprobs").reshape(total, k)
        assert (top_ids[offsets[:-1]] == -1).all() and (top_lps[offsets[:-1]] == 0).all()
        assert ((top_ids >= -1) & (top_ids < VOCAB)).all() and (top_lps <= 0).all()
        assert (np.diff(top_lps, axis=1) <= 0).all()  # most likely first
    assert set(response.sequence_losses) == set(options.losses)
    for name, value in response.sequence_losses.items():
        losses = decode_array(value, name)
        assert losses.shape == (count,) and np.isfinite(losses).all() and (losses >= 0).all()
    used = decode_array(response.num_loss_tokens, "num_loss_tokens")
    assert used.shape == (count,) and (used >= 0).all() and (used <= lengths - 1).all()
    assert not response.moe_metrics and not response.mtp_metrics  # dense model
    assert response.weights_version == WEIGHTS


def without_timings(response: pb.ScoreResponse) -> pb.ScoreResponse:
    """The response with its (run-dependent) timings cleared, for equality checks."""
    copy = pb.ScoreResponse()
    copy.CopyFrom(response)
    copy.ClearField("timings")
    return copy


def same_answer(a: pb.ScoreResponse, b: pb.ScoreResponse) -> bool:
    return without_timings(a) == without_timings(b)


def send(stub, request) -> tuple[grpc.StatusCode, object]:
    try:
        return grpc.StatusCode.OK, stub.Score(request, timeout=DEADLINE_S)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()


PROBE = pb.ScoreRequest(
    request_id="probe",
    token_ids=arr(np.arange(1, 41) * 7 % VOCAB, pb.DTYPE_INT64),
    lengths=arr([25, 1, 14], pb.DTYPE_INT64),
    options=pb.ScoreOptions(return_logprobs=True, top_k=3, losses=["nll"]),
)


def wire_payloads():
    """Garbage bytes, and valid requests truncated / corrupted at the byte level."""
    base = PROBE.SerializeToString()

    @st.composite
    def corrupted(draw):
        data = bytearray(base)
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return bytes(data)

    truncated = st.integers(0, len(base) - 1).map(lambda n: base[:n])
    return st.one_of(st.binary(max_size=256), truncated, corrupted())


def log_size(server) -> int:
    return server.log_path.stat().st_size


def assert_quiet_log(server, since: int, started: float) -> None:
    """No traceback since byte ``since`` of the server log, and at most one line about
    unparseable requests per :data:`DECODE_LOG_EVERY_S` (plus one)."""
    with open(server.log_path, errors="replace") as log:
        log.seek(since)
        text = log.read()
    # a traceback's first line (hypothesis has sent request_id="Traceback")
    assert "Traceback (most recent call last)" not in text, text[-4000:]
    assert "DecodeError'>" not in text, text[-4000:]
    lines = [line for line in text.splitlines() if UNPARSEABLE in line]
    assert len(lines) <= (time.monotonic() - started) / DECODE_LOG_EVERY_S + 1, lines


JUNK = st.text(alphabet=st.characters(codec="ascii", exclude_characters="\x00"), max_size=20)
UNLOADABLE_MODELS = st.one_of(
    st.just(""),
    JUNK.map(lambda s: f"hf:/nonexistent-{s}"),
    JUNK.map(lambda s: f"megatron:/nonexistent-{s}"),
    JUNK.map(lambda s: f"builtin:no-such-model-{s}"),
    JUNK.map(lambda s: f"tiny@{s}x"),  # a seed that is not an integer
    st.just("tiny-moe@1"),  # another architecture
)
"""LoadWeights specs that cannot load on the tiny server (INVALID_ARGUMENT or
FAILED_PRECONDITION "still serving weights ...")."""

"""UpdateWeights through the real gRPC server and batcher, on a fake engine (no torch).

Every malformed stream is answered with the documented status and a message naming
the tensor (or message) at fault, and the engine's staged tensors are dropped
(``abort_weight_update``) before the answer, the weights version unchanged: the first
message not ``begin``, no name format, an unknown name, a wrong shape, a non-float
dtype, a gap in the offsets, a tensor left half-sent, one sent twice or overfull,
both expert layouts in one push, tensors missing without ``partial``, a stream that
ends without commit (ABORTED), a second push while one is open (ABORTED), a commit
that some rank refuses (FAILED_PRECONDITION), bytes that do not parse mid-stream. A
good push stages each tensor's exact bytes (one chunk or several) and swaps in its
version, which the next Score reports. The buffers tensors are assembled in are handed
out again only once nothing uses them.
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from megascore.api.errors import CheckpointError
from megascore.api.types import LAYOUT_FUSED, LAYOUT_PER_EXPERT, WeightTarget
from megascore.api.wire import encode_array
from megascore.v1 import scoring_pb2 as pb
from megascore_server.push.chunks import KEPT_AS_RECEIVED_BYTES, PushSession, TensorBuffers
from tests.service.fake_engine import FakeEngine
from tests.service.harness import serving, wait_for

TARGETS = {
    "embed": WeightTarget((4, 3)),
    "norm": WeightTarget((5,)),
    "experts.0.w1": WeightTarget((2, 2), LAYOUT_PER_EXPERT),
    "experts.gate_up": WeightTarget((2, 2, 2), LAYOUT_FUSED),
    "lm_head": WeightTarget((4, 3), ignored=True),
}


class PushEngine(FakeEngine):
    """FakeEngine with the weight-push methods; records what it was given."""

    def __init__(self):
        super().__init__()
        self.staged: dict[str, tuple[str, tuple, bytes, int]] = {}
        self.aborts = 0
        self.refuse_commit = False

    def begin_weight_update(self, names: int, weight_set: str = ""):
        self.staged = {}
        self.events.append(("begin", names))
        return dict(TARGETS)

    def stage_weight(self, name, dtype, shape, data, layout):
        self.staged[name] = (dtype, tuple(shape), bytes(data), layout)
        self.events.append(("stage", name))

    def commit_weights(self, weights_version, partial):
        if self.refuse_commit:
            raise CheckpointError("weight push failed on ranks [1]: staging 'embed' failed")
        self.version = weights_version
        self.events.append(("commit", weights_version, partial))
        return weights_version

    def abort_weight_update(self):
        self.aborts += 1
        self.events.append(("abort",))


@pytest.fixture
def server():
    yield from serving(PushEngine(), max_batch_wait_ms=1)


def begin(names=pb.WEIGHT_NAMES_HF):
    return pb.UpdateWeightsRequest(begin=pb.UpdateWeightsBegin(names=names))


def chunk(name, shape, data: bytes, offset=0, dtype=pb.DTYPE_FLOAT32):
    return pb.UpdateWeightsRequest(
        chunk=pb.TensorChunk(
            name=name, shape=shape, offset=offset, data=pb.Array(dtype=dtype, data=data)
        )
    )


def commit(version="v1", partial=False):
    return pb.UpdateWeightsRequest(
        commit=pb.UpdateWeightsCommit(weights_version=version, partial=partial)
    )


def f32(*shape, seed=0) -> bytes:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).tobytes()


EMBED, NORM = f32(4, 3), f32(5, seed=1)


def full_push(version="v1"):
    return [
        begin(),
        chunk("embed", (4, 3), EMBED[:20]),
        chunk("embed", (4, 3), EMBED[20:], offset=20),
        chunk("norm", (5,), NORM),
        chunk("lm_head", (4, 3), EMBED),
        chunk("model.layers.0.self_attn.rotary_emb.inv_freq", (8,), f32(8)),
        chunk("experts.0.w1", (2, 2), f32(2, 2)),
        commit(version),
    ]


def push(server, messages, timeout=30):
    try:
        return server.stub().UpdateWeights(iter(messages), timeout=timeout)
    except grpc.RpcError as exc:
        return exc


def score_version(server) -> str:
    request = pb.ScoreRequest(
        token_ids=encode_array(np.array([1, 2, 3], dtype=np.int64)),
        lengths=encode_array(np.array([3], dtype=np.int64)),
        options=pb.ScoreOptions(return_logprobs=True),
    )
    return server.stub().Score(request, timeout=30).weights_version


def test_a_push_stages_exact_bytes_and_swaps_its_version(server):
    response = push(server, full_push("v1"))
    assert isinstance(response, pb.UpdateWeightsResponse), response
    assert (response.weights_version, response.previous_weights_version) == ("v1", "v0")
    assert response.num_tensors == 5 and response.num_bytes == 48 + 20 + 48 + 32 + 16
    assert response.stream_ms >= 0 and response.swap_ms >= 0
    engine = server.engine
    assert engine.staged["embed"] == ("float32", (4, 3), EMBED, 0)
    assert engine.staged["norm"] == ("float32", (5,), NORM, 0)
    assert engine.staged["experts.0.w1"][3] == LAYOUT_PER_EXPERT
    assert set(engine.staged) == {"embed", "norm", "experts.0.w1"}  # ignored: not staged
    assert engine.events[-1] == ("commit", "v1", False) and engine.aborts == 0
    assert score_version(server) == "v1"
    assert server.stub().GetModelInfo(pb.GetModelInfoRequest()).weights_version == "v1"
    # bf16 / fp16 travel as such; an empty version is generated; partial pushes
    bf16 = chunk("norm", (5,), b"\x01\x02" * 5, dtype=pb.DTYPE_BFLOAT16)
    response = push(server, [begin(), bf16, commit("", partial=True)])
    assert response.weights_version.startswith("push-"), response
    assert engine.staged["norm"] == ("bfloat16", (5,), b"\x01\x02" * 5, 0)
    assert engine.events[-1][2] is True


BAD_STREAMS = {  # name -> (messages, code, substrings of the message)
    "no begin": ([chunk("norm", (5,), NORM), commit()], "INVALID_ARGUMENT", ["starts with begin"]),
    "no names": ([begin(pb.WEIGHT_NAMES_UNSPECIFIED), commit()], "INVALID_ARGUMENT", ["names"]),
    "unknown name": (
        [begin(), chunk("embed.bogus", (5,), NORM), commit()],
        "INVALID_ARGUMENT",
        ["message 1, tensor 'embed.bogus'", "not a tensor of the served model"],
    ),
    "wrong shape": (
        [begin(), chunk("embed", (3, 4), EMBED), commit()],
        "INVALID_ARGUMENT",
        ["'embed'", "shape [3, 4]", "[4, 3]"],
    ),
    "int dtype": (
        [begin(), chunk("norm", (5,), b"\0" * 20, dtype=pb.DTYPE_INT32), commit()],
        "INVALID_ARGUMENT",
        ["'norm'", "DTYPE_INT32 not accepted"],
    ),
    "offset gap": (
        [begin(), chunk("embed", (4, 3), EMBED[:8]), chunk("embed", (4, 3), EMBED[12:], 12)],
        "INVALID_ARGUMENT",
        ["message 2, tensor 'embed'", "offset 12, expected 8"],
    ),
    "next tensor too early": (
        [begin(), chunk("embed", (4, 3), EMBED[:8]), chunk("norm", (5,), NORM), commit()],
        "INVALID_ARGUMENT",
        ["'embed' got 8 of its 48 bytes"],
    ),
    "half sent at commit": (
        [begin(), chunk("embed", (4, 3), EMBED[:8]), commit(partial=True)],
        "INVALID_ARGUMENT",
        ["commit: tensor 'embed' got 8 of its 48 bytes"],
    ),
    "sent twice": (
        [begin(), chunk("norm", (5,), NORM), chunk("norm", (5,), NORM), commit()],
        "INVALID_ARGUMENT",
        ["message 2, tensor 'norm'", "sent twice"],
    ),
    "overfull": (
        [begin(), chunk("norm", (5,), NORM + b"1234"), commit()],
        "INVALID_ARGUMENT",
        ["'norm'", "more than the 20 bytes"],
    ),
    "two expert layouts": (
        [
            begin(),
            chunk("experts.0.w1", (2, 2), f32(2, 2)),
            chunk("experts.gate_up", (2, 2, 2), f32(2, 2, 2)),
        ],
        "INVALID_ARGUMENT",
        ["'experts.gate_up'", "fused", "per-expert"],
    ),
    "missing without partial": (
        [begin(), chunk("norm", (5,), NORM), commit()],
        "INVALID_ARGUMENT",
        [
            "2 tensors of the model were not sent",
            "'embed'",
            "'experts.0.w1'",
            "partial=True (SDK push_weights)",
            "--partial (megascore push-weights)",
        ],
    ),
    "long name": (
        [begin(), chunk("x" * 5000, (5,), NORM), commit()],
        "INVALID_ARGUMENT",
        ["tensor 'xxxx", "(5000 characters)", "not a tensor"],
    ),
    "long version": (
        [*full_push()[:-1], commit("v" * 300)],
        "INVALID_ARGUMENT",
        ["commit.weights_version: 300 characters, more than 256"],
    ),
    "begin twice": ([begin(), begin()], "INVALID_ARGUMENT", ["message 1: begin inside a push"]),
    "no commit": (
        [begin(), chunk("norm", (5,), NORM)],
        "ABORTED",
        ["ended after 2 messages without a commit"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_STREAMS))
def test_bad_streams_are_refused_and_nothing_changes(server, case):
    messages, code, needles = BAD_STREAMS[case]
    error = push(server, messages)
    assert isinstance(error, grpc.RpcError), error
    assert error.code().name == code, error.details()
    for needle in needles:
        assert needle in error.details(), (needle, error.details())
    opened = messages[0].WhichOneof("step") == "begin" and messages[0].begin.names
    assert server.engine.aborts == (1 if opened else 0)
    assert not any(e[0] == "commit" for e in server.engine.events)
    assert score_version(server) == "v0"
    assert isinstance(push(server, full_push("after")), pb.UpdateWeightsResponse)  # not busy


def test_a_stream_that_has_sent_nothing_holds_no_push(server):
    """A stream the server took but that has sent no message yet (a probe, a slow client)
    does not turn away a push arriving meanwhile; sending its begin later, it is the one
    refused while that push is open, and it may push once that push ended."""
    release, go_on = threading.Event(), threading.Event()

    def silent():
        release.wait(30)
        yield from full_push("late")

    def held():
        yield begin()
        go_on.wait(30)
        yield from full_push("first")[1:]

    waiting = server.stub().UpdateWeights.future(silent(), timeout=30)
    wait_for(lambda: server.handles.gate.active_calls == 1, what="the silent stream taken")
    first = server.stub().UpdateWeights.future(held(), timeout=30)
    wait_for(lambda: any(e[0] == "begin" for e in server.engine.events), what="the push opened")
    release.set()
    error = waiting.exception(timeout=30)
    assert error.code() is grpc.StatusCode.ABORTED and "in progress" in error.details()
    go_on.set()
    assert first.result(timeout=30).weights_version == "first"
    assert isinstance(push(server, full_push("later")), pb.UpdateWeightsResponse)
    assert score_version(server) == "later"


def test_a_second_push_is_aborted_while_one_is_open(server):
    release = threading.Event()

    def slow():
        yield begin()
        yield chunk("norm", (5,), NORM)
        release.wait(30)
        yield from full_push("first")[1:]

    future = server.stub().UpdateWeights.future(slow(), timeout=30)
    while not any(e == ("stage", "norm") for e in server.engine.events):
        threading.Event().wait(0.01)
    error = push(server, full_push("second"))
    assert error.code() is grpc.StatusCode.ABORTED and "in progress" in error.details()
    assert score_version(server) == "v0"  # scoring goes on while a push is open
    release.set()
    error = future.exception()  # 'norm' sent twice by the slow stream
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and "sent twice" in error.details()
    assert push(server, full_push("third")).weights_version == "third"


def test_a_commit_refused_by_a_rank_keeps_the_old_version(server):
    server.engine.refuse_commit = True
    error = push(server, full_push("v9"))
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "ranks [1]" in error.details() and "'embed'" in error.details()
    assert score_version(server) == "v0"
    server.engine.refuse_commit = False
    assert push(server, full_push("v10")).weights_version == "v10"


def test_garbage_mid_push_is_invalid_argument_and_drops_the_push(server):
    payloads = [begin().SerializeToString(), chunk("norm", (5,), NORM).SerializeToString()]
    payloads.append(b"\xff\xff\xff")
    call = server.channel().stream_unary("/megascore.v1.Scorer/UpdateWeights")
    with pytest.raises(grpc.RpcError) as info:
        call(iter(payloads), timeout=10)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details()
    assert "does not parse as megascore.v1.UpdateWeightsRequest" in details, details
    assert "stream message 2" in details, details
    assert server.engine.aborts == 1 and score_version(server) == "v0"


# ---- two phases: prepare, then FinishWeightUpdate ---------------------------------------------


def prepared_push(version="v1", timeout_s=0.0):
    messages = full_push(version)
    messages[-1].commit.prepare = True
    messages[-1].commit.prepare_timeout_s = timeout_s
    return messages


def finish(server, push_id, commit=True):
    request = pb.FinishWeightUpdateRequest(push_id=push_id, commit=commit)
    try:
        return server.stub().FinishWeightUpdate(request, timeout=30)
    except grpc.RpcError as exc:
        return exc


def test_a_prepared_push_holds_its_tensors_until_the_commit(server):
    engine = server.engine
    response = push(server, prepared_push("v1"))
    assert response.prepared and response.push_id
    assert (response.weights_version, response.previous_weights_version) == ("v1", "v0")
    assert set(engine.staged) == {"embed", "norm", "experts.0.w1"} and engine.aborts == 0
    assert score_version(server) == "v0"  # the old weights serve on
    second = push(server, full_push("v2"))
    assert second.code() is grpc.StatusCode.ABORTED  # the prepared push holds the slot
    done = finish(server, response.push_id)
    assert (done.weights_version, done.previous_weights_version) == ("v1", "v0")
    assert not done.prepared and done.num_tensors == 5
    assert engine.events[-1] == ("commit", "v1", False)
    assert score_version(server) == "v1"
    again = finish(server, response.push_id)
    assert again.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert response.push_id in again.details()


def test_an_aborted_prepared_push_changes_nothing(server):
    engine = server.engine
    response = push(server, prepared_push("v1"))
    done = finish(server, response.push_id, commit=False)
    assert done.weights_version == "v0" and engine.aborts == 1
    assert score_version(server) == "v0"
    assert push(server, full_push("v3")).weights_version == "v3"  # the slot is free


def test_a_prepared_push_that_hears_nothing_is_dropped(server):
    engine = server.engine
    response = push(server, prepared_push("v1", timeout_s=0.3))
    wait_for(lambda: engine.aborts == 1, what="the prepared push dropped")
    assert score_version(server) == "v0"
    late = finish(server, response.push_id)
    assert late.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "prepare_timeout_s" in late.details()
    assert push(server, full_push("v4")).weights_version == "v4"


def test_a_bad_prepare_timeout_is_invalid(server):
    response = push(server, prepared_push("v1", timeout_s=-1))
    assert response.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "commit.prepare_timeout_s" in response.details()
    assert server.engine.aborts == 1 and score_version(server) == "v0"


def test_tensor_buffers_are_reused_once_nothing_uses_them():
    buffers = TensorBuffers(limit=150)
    first = buffers.take(100)
    base = id(first.base)  # (an id: a reference would count as a use)
    engine_view = np.frombuffer(first, np.uint8)  # e.g. a tensor waiting for its partners
    del first
    other = buffers.take(100)
    assert id(other.base) != base  # still in use: not handed out again
    del engine_view
    again = buffers.take(100)
    assert id(again.base) == base  # back once nothing used it
    del other, again  # two free buffers, room for one under the limit
    assert sum(len(v) for v in buffers._free.values()) == 1


def test_a_small_whole_tensor_is_staged_on_its_message_bytes():
    big = KEPT_AS_RECEIVED_BYTES // 4 + 1  # float32 elements: one over the bound
    targets = {
        "small": WeightTarget((4,)),
        "split": WeightTarget((4,)),
        "big": WeightTarget((big,)),
    }
    session = PushSession(targets, pb.WEIGHT_NAMES_HF, buffers=TensorBuffers(1 << 30))

    def piece(name, values, offset=0):
        shape = targets[name].shape
        array = pb.Array(dtype=pb.DTYPE_FLOAT32, data=np.asarray(values, np.float32).tobytes())
        return pb.TensorChunk(name=name, shape=shape, data=array, offset=offset)

    small = session.add(piece("small", [1, 2, 3, 4]), 1)
    assert isinstance(small.data.base, bytes) and not small.data.flags.writeable  # not copied
    assert np.frombuffer(small.data, np.float32).tolist() == [1, 2, 3, 4]
    assert session.add(piece("split", [5, 6]), 2) is None  # in two chunks: assembled
    split = session.add(piece("split", [7, 8], offset=8), 3)
    assert split.data.flags.writeable and np.frombuffer(split.data, np.float32).tolist() == [
        5,
        6,
        7,
        8,
    ]
    whole = session.add(piece("big", np.arange(big)), 4)  # whole, over the bound: a pooled copy
    assert whole.data.flags.writeable and np.array_equal(
        np.frombuffer(whole.data, np.float32), np.arange(big)
    )
    assert session.num_bytes == 16 + 16 + 4 * big

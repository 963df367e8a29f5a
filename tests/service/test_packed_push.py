"""UpdateWeights messages that carry several tensor pieces (``chunks``), through the real
gRPC server and batcher on the fake push engine (no torch).

A packed stream stages exactly what the same pieces one to a message stage (bit for
bit, the same response counts); a bad piece inside a pack is refused as a lone chunk
would be (INVALID_ARGUMENT naming its tensor and its place in the message), the staged
tensors dropped and the version unchanged; the server says it takes them
(``ModelInfo.accepts_tensor_chunks``), and the SDK then packs a push's small tensors:
what the engine stages is the same as from a push one tensor a message.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from megascore.v1 import scoring_pb2 as pb
from megascore_client import ScoringClient
from megascore_server.push import pusher
from tests.service.harness import serving
from tests.service.test_weight_push import (
    EMBED,
    NORM,
    PushEngine,
    begin,
    chunk,
    commit,
    f32,
    full_push,
    push,
    score_version,
)


@pytest.fixture
def server():
    yield from serving(PushEngine(), max_batch_wait_ms=1)


def packed(*messages: pb.UpdateWeightsRequest) -> pb.UpdateWeightsRequest:
    """One ``chunks`` message of the pieces of ``messages`` (each a lone ``chunk``)."""
    return pb.UpdateWeightsRequest(chunks=pb.TensorChunks(chunks=[m.chunk for m in messages]))


def test_packed_pieces_stage_exactly_as_lone_chunks(server):
    assert server.stub().GetModelInfo(pb.GetModelInfoRequest()).accepts_tensor_chunks
    lone = full_push("v1")
    expected = push(server, lone)
    assert isinstance(expected, pb.UpdateWeightsResponse), expected
    staged = dict(server.engine.staged)
    # a pack may hold a tensor's last piece and the next ones whole; an empty pack is
    # nothing; a lone chunk may follow a pack
    pieces = lone[1:-1]
    messages = [
        begin(),
        pieces[0],
        packed(*pieces[1:4]),
        pb.UpdateWeightsRequest(chunks=pb.TensorChunks()),
        packed(pieces[4]),
        pieces[5],
        commit("v2"),
    ]
    response = push(server, messages)
    assert isinstance(response, pb.UpdateWeightsResponse), response
    assert (response.weights_version, response.previous_weights_version) == ("v2", "v1")
    assert (response.num_tensors, response.num_bytes) == (
        expected.num_tensors,
        expected.num_bytes,
    )
    assert server.engine.staged == staged  # the same names, dtypes, shapes, bytes, layouts
    assert server.engine.staged["embed"][2] == EMBED and server.engine.aborts == 0
    assert score_version(server) == "v2"


BAD_PACKS = {  # name -> (messages, substrings of the INVALID_ARGUMENT message)
    "wrong shape": (
        [begin(), packed(chunk("norm", (5,), NORM), chunk("embed", (3, 4), EMBED)), commit()],
        ["message 1 (piece 2 of 2), tensor 'embed'", "shape [3, 4]", "[4, 3]"],
    ),
    "unknown name": (
        [begin(), packed(chunk("bogus", (5,), NORM), chunk("norm", (5,), NORM)), commit()],
        ["message 1 (piece 1 of 2), tensor 'bogus'", "not a tensor of the served model"],
    ),
    "int dtype": (
        [begin(), packed(chunk("norm", (5,), b"\0" * 20, dtype=pb.DTYPE_INT32)), commit()],
        ["tensor 'norm'", "DTYPE_INT32 not accepted"],
    ),
    "sent twice in one pack": (
        [begin(), packed(chunk("norm", (5,), NORM), chunk("norm", (5,), NORM)), commit()],
        ["message 1 (piece 2 of 2), tensor 'norm'", "sent twice"],
    ),
    "offset gap across packs": (
        [
            begin(),
            packed(chunk("norm", (5,), NORM), chunk("embed", (4, 3), EMBED[:8])),
            packed(chunk("embed", (4, 3), EMBED[12:], 12)),
            commit(),
        ],
        ["message 2 (piece 1 of 1), tensor 'embed'", "offset 12, expected 8"],
    ),
    "next tensor too early": (
        [begin(), packed(chunk("embed", (4, 3), EMBED[:8]), chunk("norm", (5,), NORM))],
        ["'embed' got 8 of its 48 bytes"],
    ),
    "overfull": (
        [begin(), packed(chunk("norm", (5,), NORM + b"1234")), commit()],
        ["tensor 'norm'", "more than the 20 bytes"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_PACKS))
def test_a_bad_piece_in_a_pack_is_refused_naming_its_tensor(server, case):
    messages, needles = BAD_PACKS[case]
    error = push(server, messages)
    assert isinstance(error, grpc.RpcError), error
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    for needle in needles:
        assert needle in error.details(), (needle, error.details())
    assert server.engine.aborts == 1
    assert not any(e[0] == "commit" for e in server.engine.events)
    assert score_version(server) == "v0"
    assert isinstance(push(server, full_push("after")), pb.UpdateWeightsResponse)  # not busy


def test_the_sdk_packs_small_tensors_and_stages_the_same_bytes(server, monkeypatch):
    """The SDK learns ``accepts_tensor_chunks`` and packs; what is staged equals a push
    with packing off (one tensor a message) bit for bit."""
    tensors = [
        ("embed", np.frombuffer(EMBED, np.float32).reshape(4, 3)),
        ("norm", np.frombuffer(NORM, np.float32)),
        ("lm_head", np.frombuffer(EMBED, np.float32).reshape(4, 3)),
        ("experts.0.w1", np.frombuffer(f32(2, 2, seed=3), np.float32).reshape(2, 2)),
    ]
    seen: list[pb.UpdateWeightsRequest] = []  # what the server read after the begin
    stage_all = pusher.WeightPusher._stage_all

    async def counting(self, iterator, session, batcher):
        async def each():
            async for message in iterator:
                seen.append(message)
                yield message

        return await stage_all(self, each(), session, batcher)

    monkeypatch.setattr(pusher.WeightPusher, "_stage_all", counting)
    with ScoringClient(f"127.0.0.1:{server.port}", timeout=30) as client:
        client._packs[(client.target,)] = False  # packing off: one tensor a message
        client.push_weights(tensors, weights_version="lone")
        lone = dict(server.engine.staged)
        assert [m.WhichOneof("step") for m in seen] == ["chunk"] * 4 + ["commit"]
        client._packs.clear()  # learned again from ModelInfo
        seen.clear()
        result = client.push_weights(tensors, weights_version="packed")
    assert [m.WhichOneof("step") for m in seen] == ["chunks", "commit"]
    assert len(seen[0].chunks.chunks) == 4
    assert result.weights_version == "packed" and result.num_tensors == 4
    assert server.engine.staged == lone

"""The SDK packs a push's small tensors several to a message (``chunks``) for a server
whose ModelInfo says ``accepts_tensor_chunks``, and only for one.

A recording sink answers GetModelInfo with the field set or not (or has no
GetModelInfo at all: an older server); its UpdateWeights reassembles every tensor
from the messages. Consecutive tensors that fit in one chunk go together, each message
under ``chunk_bytes`` of serialized pieces; a tensor bigger than a chunk keeps its own
chunked messages (the pack before it sent first); the bytes arrive unchanged. A delta's
patches pack too, an adapter push (168 small tensors) takes a handful of messages, a
push to several replicas packs only when every one takes them, and the asyncio client
sends the same messages.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest

from megascore.v1 import scoring_pb2 as pb
from megascore_client import AsyncScoringClient, ScoringClient


class Sink:
    """A gRPC server recording every UpdateWeights message; ``packs`` is the
    ``accepts_tensor_chunks`` of its ModelInfo (None: no GetModelInfo, UNIMPLEMENTED)."""

    def __init__(self, packs: bool | None):
        self.packs = packs
        self.calls: list[list[pb.UpdateWeightsRequest]] = []
        self.info_calls = 0
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        handlers = {
            "UpdateWeights": grpc.stream_unary_rpc_method_handler(
                self._update,
                request_deserializer=pb.UpdateWeightsRequest.FromString,
                response_serializer=pb.UpdateWeightsResponse.SerializeToString,
            ),
            "FinishWeightUpdate": grpc.unary_unary_rpc_method_handler(
                self._finish,
                request_deserializer=pb.FinishWeightUpdateRequest.FromString,
                response_serializer=pb.UpdateWeightsResponse.SerializeToString,
            ),
        }
        if packs is not None:
            handlers["GetModelInfo"] = grpc.unary_unary_rpc_method_handler(
                self._info,
                request_deserializer=pb.GetModelInfoRequest.FromString,
                response_serializer=pb.ModelInfo.SerializeToString,
            )
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("megascore.v1.Scorer", handlers)]
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _info(self, request, context):
        self.info_calls += 1
        return pb.ModelInfo(name="sink", accepts_tensor_chunks=self.packs)

    def _update(self, requests, context):
        messages = list(requests)
        with self._lock:
            self.calls.append(messages)
        last = messages[-1].commit
        return pb.UpdateWeightsResponse(
            weights_version=last.weights_version or "generated",
            prepared=last.prepare,
            push_id="p1" if last.prepare else "",
        )

    def _finish(self, request, context):
        return pb.UpdateWeightsResponse(weights_version="done")

    def tensors(self, call: int = -1) -> dict[str, bytes]:
        """name -> bytes reassembled from one call's pieces, lone or packed (checks order)."""
        out: dict[str, bytes] = {}
        for message in self.calls[call]:
            kind = message.WhichOneof("step")
            pieces = [message.chunk] if kind == "chunk" else []
            for c in message.chunks.chunks if kind == "chunks" else pieces:
                data = out.get(c.name, b"")
                assert c.offset == len(data), (c.name, c.offset, len(data))
                out[c.name] = data + c.data.data
        return out

    def kinds(self, call: int = -1) -> list[str]:
        return [m.WhichOneof("step") for m in self.calls[call]]


@pytest.fixture(scope="module")
def sinks():
    made = {packs: Sink(packs) for packs in (True, False, None)}
    yield made
    for sink in made.values():
        sink.server.stop(None)


def adapter_like(seed=0) -> list[tuple[str, np.ndarray]]:
    """168 small tensors (an r=16-like adapter's count) and one big one in the middle."""
    gen = np.random.default_rng(seed)
    tensors = [(f"t{i}.lora_A.weight", gen.standard_normal((4, 64), np.float32)) for i in range(84)]
    tensors.append(("big", gen.standard_normal((300, 100), np.float32)))  # 120 000 bytes
    tensors += [
        (f"u{i}.lora_B.weight", gen.standard_normal((64, 4), np.float32)) for i in range(84)
    ]
    return tensors


def test_small_tensors_go_several_to_a_message_under_the_chunk_size(sinks):
    sink, tensors = sinks[True], adapter_like()
    sent, asked = [], sink.info_calls  # the module's other tests use this sink too
    with ScoringClient(sink.target) as client:
        result = client.push_weights(
            tensors, weights_version="v1", partial=True, chunk_bytes=32 * 1024,
            progress=lambda n, name: sent.append((n, name)),
        )  # fmt: skip
    assert sink.info_calls == asked + 1 and result.weights_version == "v1"
    assert sink.tensors() == {name: t.tobytes() for name, t in tensors}  # bit for bit
    kinds = sink.kinds()
    # 84 x 1 KiB before "big": 3 packs (31 + 31 + 22); big: 4 chunks of <= 32 KiB; then 3
    assert kinds == ["begin", *["chunks"] * 3, *["chunk"] * 4, *["chunks"] * 3, "commit"]
    packs = [m for m in sink.calls[-1] if m.WhichOneof("step") == "chunks"]
    assert all(m.ByteSize() <= 32 * 1024 + 16 for m in packs)
    assert sum(len(m.chunks.chunks) for m in packs) == 168
    assert all(c.offset == 0 and len(c.data.data) == 1024 for m in packs for c in m.chunks.chunks)
    # progress: once per tensor of a pack (in order), once per chunk of the big one
    assert [name for _, name in sent] == [n for n, _ in tensors[:84]] + ["big"] * 4 + [
        n for n, _ in tensors[85:]
    ]
    assert sent[-1][0] == sum(t.nbytes for _, t in tensors)

    with ScoringClient(sink.target) as client:  # the default chunk size (8 MiB): one message
        client.push_weights(tensors, partial=True)
        assert sink.kinds() == ["begin", "chunks", "commit"]
        client.push_weights(tensors[:3], partial=True)  # asked once per client
    assert sink.info_calls == asked + 2
    assert sink.kinds() == ["begin", "chunks", "commit"]


@pytest.mark.parametrize("packs", [False, None], ids=["field unset", "no GetModelInfo"])
def test_an_older_server_gets_one_tensor_a_message(sinks, packs):
    sink, tensors = sinks[packs], adapter_like(1)
    with ScoringClient(sink.target) as client:
        client.push_weights(tensors, partial=True, chunk_bytes=32 * 1024)
        client.push_weights(tensors[:2], partial=True)
    assert sink.tensors(-2) == {name: t.tobytes() for name, t in tensors}
    assert sink.kinds(-2) == ["begin", *["chunk"] * (168 + 4), "commit"]
    assert sink.kinds() == ["begin", "chunk", "chunk", "commit"]


def test_a_deltas_patches_pack_too(sinks):
    sink = sinks[True]
    tensors = adapter_like(2)[:10]
    with ScoringClient(sink.target) as client:
        client.push_weights(tensors, partial=True, delta=True)  # full (no base yet)
        changed = [(name, t.copy()) for name, t in tensors]
        for _, t in changed[::2]:
            t[0, 0] += 1  # one element: a patch
        client.push_weights(changed, partial=True, delta=True)
    assert sink.kinds() == ["begin", "chunks", "commit"]
    pieces = sink.calls[-1][1].chunks.chunks
    assert [c.name for c in pieces] == [name for name, _ in tensors[::2]]
    assert all(len(c.indices.data) == 4 and c.offset == 0 for c in pieces)


def test_several_replicas_pack_only_when_every_one_takes_them(sinks):
    tensors = adapter_like(3)[:5]
    new, old = sinks[True], sinks[False]
    with ScoringClient(new.target) as client:
        client.push_weights(tensors, partial=True, replicas=[new.target, old.target])
        assert new.kinds()[1:3] == ["chunk", "chunk"] and old.kinds() == new.kinds()
        other = Sink(True)
        try:
            client.push_weights(tensors, partial=True, replicas=[new.target, other.target])
            assert new.kinds() == ["begin", "chunks", "commit"] == other.kinds()
            assert other.tensors() == {name: t.tobytes() for name, t in tensors}
        finally:
            other.server.stop(None)


def test_the_async_client_packs_the_same(sinks):
    sink, tensors = sinks[True], adapter_like(4)

    async def main():
        async with AsyncScoringClient(sink.target) as client:
            await client.push_weights(tensors, partial=True, chunk_bytes=32 * 1024)

    asyncio.run(main())
    assert sink.tensors() == {name: t.tobytes() for name, t in tensors}
    assert sink.kinds().count("chunks") == 6

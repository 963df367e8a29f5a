"""SDK ``push_weights`` / ``megascore push-weights`` against a recording UpdateWeights sink.

What goes on the wire is checked against the tensors themselves: numpy fp32 / fp16
/ fp64 and torch fp32 / bf16 (raw 2-byte elements, bit for bit) arrive as their
own bytes, chunked under ``chunk_bytes`` with consecutive offsets, between a
``begin`` and a ``commit`` carrying the version and ``partial``. A tensor the SDK
cannot push raises InvalidInputError and the stream ends without a commit (the
server then drops what it staged). The CLI pushes a safetensors file (bf16 kept)
with a progress bar on stderr and the result as JSON on stdout; the async client
sends the same messages.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest

from megascore.v1 import scoring_pb2 as pb
from megascore_client import AsyncScoringClient, InvalidInputError, ScoringClient, cli
from megascore_client.push.requests import RawTensor, read_safetensors


class Sink:
    """A sync gRPC server whose UpdateWeights records every message of every call."""

    def __init__(self):
        self.calls: list[list[pb.UpdateWeightsRequest]] = []
        self.delay_s = 0.0  # how long the swap after the commit takes
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        handler = grpc.stream_unary_rpc_method_handler(
            self._update,
            request_deserializer=pb.UpdateWeightsRequest.FromString,
            response_serializer=pb.UpdateWeightsResponse.SerializeToString,
        )
        self.server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "megascore.v1.Scorer", {"UpdateWeights": handler}
                )
            ]
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _update(self, requests, context):
        messages = []
        with self._lock:
            self.calls.append(messages)
        for message in requests:
            messages.append(message)
        if not messages or messages[-1].WhichOneof("step") != "commit":
            context.abort(grpc.StatusCode.ABORTED, "no commit")
        chunks = [m.chunk for m in messages if m.WhichOneof("step") == "chunk"]
        time.sleep(self.delay_s)
        return pb.UpdateWeightsResponse(
            weights_version=messages[-1].commit.weights_version or "generated",
            previous_weights_version="before",
            num_tensors=sum(c.offset == 0 for c in chunks),
            num_bytes=sum(len(c.data.data) for c in chunks),
        )

    def tensors(self, call: int = -1) -> dict[str, tuple[tuple[int, ...], int, bytes]]:
        """name -> (shape, dtype, bytes) reassembled from one call's chunks (checks offsets)."""
        out: dict[str, list] = {}
        for message in self.calls[call]:
            if message.WhichOneof("step") != "chunk":
                continue
            c = message.chunk
            shape, dtype, data = out.setdefault(c.name, [tuple(c.shape), c.data.dtype, b""])
            assert c.offset == len(data), (c.name, c.offset, len(data))
            assert (tuple(c.shape), c.data.dtype) == (shape, dtype)
            out[c.name][2] = data + c.data.data
        return {k: tuple(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def sink():
    s = Sink()
    yield s
    s.server.stop(None)


def test_numpy_and_torch_tensors_travel_as_their_own_bytes(sink):
    torch = pytest.importorskip("torch")
    gen = np.random.default_rng(0)
    a32 = gen.standard_normal((64, 33)).astype(np.float32)
    a16 = gen.standard_normal((7,)).astype(np.float16)
    a64 = gen.standard_normal((3, 2)).astype(np.float64)
    tb = torch.randn(40, 20).to(torch.bfloat16)
    t32 = torch.randn(5, 6)[:, ::2]  # non-contiguous
    sent = []
    with ScoringClient(f"127.0.0.1:{sink.port}") as client:
        result = client.push_weights(
            [("a32", a32), ("a16", a16), ("a64", a64), ("tb", tb), ("t32", t32)],
            weights_version="v7",
            partial=True,
            chunk_bytes=1000,
            progress=lambda n, name: sent.append((n, name)),
        )
    messages = sink.calls[-1]
    assert messages[0].begin.names == pb.WEIGHT_NAMES_HF
    assert messages[-1].commit.weights_version == "v7" and messages[-1].commit.partial
    assert all(len(m.chunk.data.data) <= 1000 for m in messages[1:-1])
    got = sink.tensors()
    assert got["a32"] == ((64, 33), pb.DTYPE_FLOAT32, a32.tobytes())
    assert got["a16"] == ((7,), pb.DTYPE_FLOAT16, a16.tobytes())
    assert got["a64"] == ((3, 2), pb.DTYPE_FLOAT64, a64.tobytes())
    assert got["tb"][:2] == ((40, 20), pb.DTYPE_BFLOAT16)
    assert got["tb"][2] == tb.view(torch.int16).numpy().tobytes()  # bf16 bits unchanged
    assert got["t32"] == ((5, 3), pb.DTYPE_FLOAT32, t32.contiguous().numpy().tobytes())
    total = sum(len(v[2]) for v in got.values())
    assert result.num_bytes == total and result.num_tensors == 5
    assert result.weights_version == "v7" and result.previous_weights_version == "before"
    assert result.seconds > 0 and result.bytes_per_s == pytest.approx(total / result.seconds)
    assert [n for n, _ in sent] == sorted(n for n, _ in sent) and sent[-1][0] == total
    assert len(messages) - 2 == len(sent) == sum(-(-len(v[2]) // 1000) for v in got.values())


def test_a_tensor_that_cannot_be_pushed_ends_the_stream_without_commit(sink):
    with ScoringClient(f"127.0.0.1:{sink.port}") as client:
        tensors = [("ok", np.ones(4, np.float32)), ("ids", np.arange(4))]
        with pytest.raises(InvalidInputError, match="'ids': dtype int64"):
            client.push_weights(iter(tensors))
        assert [m.WhichOneof("step") for m in sink.calls[-1]] == ["begin", "chunk"]
        with pytest.raises(InvalidInputError, match="12 bytes for shape"):
            client.push_weights([("raw", RawTensor("float32", (2, 2), b"x" * 12))])
        with pytest.raises(InvalidInputError, match="names must be one of"):
            client.push_weights([], names="gguf")


def test_megatron_names_and_the_async_client(sink):
    async def push():
        async with AsyncScoringClient(f"127.0.0.1:{sink.port}") as client:
            return await client.push_weights(
                [("decoder.final_layernorm.weight", np.ones(8, np.float32))], names="megatron"
            )

    result = asyncio.run(push())
    assert result.weights_version == "generated" and result.num_bytes == 32
    assert sink.calls[-1][0].begin.names == pb.WEIGHT_NAMES_MEGATRON
    assert sink.calls[-1][-1].commit.weights_version == ""


def test_cli_pushes_a_safetensors_file_with_a_progress_bar(sink, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    tensors = {"w": torch.randn(300, 70).to(torch.bfloat16), "b": torch.randn(9)}
    save_file(tensors, tmp_path / "model.safetensors")
    read = dict(read_safetensors(tmp_path))
    assert read["w"].dtype == "bfloat16" and read["w"].shape == (300, 70)
    assert read["w"].data == tensors["w"].view(torch.int16).numpy().tobytes()
    code = cli.main(
        ["push-weights", str(tmp_path), "--target", f"127.0.0.1:{sink.port}"]
        + ["--weights-version", "cli-1"]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    assert result["weights_version"] == "cli-1" and result["num_bytes"] == 300 * 70 * 2 + 36
    assert "100%" in err and "MB/s" in err
    got = sink.tensors()
    assert got["w"] == ((300, 70), pb.DTYPE_BFLOAT16, read["w"].data)
    assert got["b"] == ((9,), pb.DTYPE_FLOAT32, tensors["b"].numpy().tobytes())


def test_cli_push_honours_timeout(sink, tmp_path, capsys):
    """``push-weights --timeout`` is the deadline of the push, not a fixed 1800 s."""
    from safetensors.numpy import save_file

    save_file({"w": np.ones((4, 4), np.float32)}, str(tmp_path / "model.safetensors"))
    argv = ["push-weights", str(tmp_path), "--target", f"127.0.0.1:{sink.port}", "--no-progress"]
    sink.delay_s = 1.5
    try:
        assert cli.main([*argv, "--timeout", "0.3"]) == 1
        assert "DEADLINE_EXCEEDED" in capsys.readouterr().err
        assert cli.main([*argv, "--timeout", "30"]) == 0
        assert json.loads(capsys.readouterr().out)["num_bytes"] == 64
    finally:
        sink.delay_s = 0.0


def test_the_old_version_keyword_still_works_and_warns(sink):
    """``push_weights`` names the label ``weights_version`` like ``load_weights``; the old
    ``version=`` keyword sends the same commit, with a DeprecationWarning."""
    tensor = [("a", np.zeros(3, np.float32))]
    with ScoringClient(f"127.0.0.1:{sink.port}") as client:
        with pytest.warns(DeprecationWarning, match="weights_version"):
            result = client.push_weights(tensor, version="old", partial=True)
        assert sink.calls[-1][-1].commit.weights_version == "old"
        assert result.weights_version == "old"
        with pytest.raises(InvalidInputError, match="disagree"):
            client.push_weights(tensor, weights_version="a", version="b", partial=True)

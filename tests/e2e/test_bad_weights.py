"""Issue 43 item 5 through the real server: bad weights are refused with an error that names
the file (or the pushed message) and the tensor, and the replica keeps serving its old weights.

On the session's shared ``--nproc 1`` server of the built-in ``tiny`` (``tp1``):

* ``LoadWeights`` of ``hf:DIR`` checkpoints with tiny's architecture, each damaged one way
  (a file cut inside a tensor, a bit flipped in a header, an index naming a shard that is
  gone, tensors of another shape than ``config.json`` implies) answers FAILED_PRECONDITION
  naming the file and the tensor, "...; still serving weights 'builtin:tiny@1234'";
* ``UpdateWeights`` with a tensor of the wrong shape or dtype, full or as a delta against
  the copy an earlier push kept, answers INVALID_ARGUMENT naming the message and the tensor;

and after each, the next ``Score`` returns the bytes it returned before any of them. A
start-up on a cut file (``megascore serve --model hf:DIR``) exits non-zero, naming the file
and the tensor, before it ever serves.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import grpc
import numpy as np
import pytest
from safetensors.numpy import save_file

from megascore.v1 import scoring_pb2 as pb
from megascore_client import ScoringClient, ScoringError
from testkit.reference import VOCAB, WEIGHTS

pytestmark = pytest.mark.timeout(300)

TINY = dict(  # the built-in tiny's architecture as a transformers config
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=VOCAB,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
)
SEQUENCES = [np.random.default_rng(3).integers(0, VOCAB, n).tolist() for n in (1, 7, 30)]
NORM = "model.norm.weight"  # RMSNorm weights start at one in Megatron: pushing ones changes nothing


def _tensors(intermediate: int = TINY["intermediate_size"]) -> dict[str, np.ndarray]:
    """Random HF tensors of tiny's shapes (MLP ``intermediate`` wide)."""
    hidden = TINY["hidden_size"]
    kv = hidden // TINY["num_attention_heads"] * TINY["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (VOCAB, hidden), NORM: (hidden,)}
    shapes["lm_head.weight"] = (VOCAB, hidden)
    for i in range(TINY["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        for name, shape in {
            "self_attn.q_proj.weight": (hidden, hidden),
            "self_attn.k_proj.weight": (kv, hidden),
            "self_attn.v_proj.weight": (kv, hidden),
            "self_attn.o_proj.weight": (hidden, hidden),
            "mlp.gate_proj.weight": (intermediate, hidden),
            "mlp.up_proj.weight": (intermediate, hidden),
            "mlp.down_proj.weight": (hidden, intermediate),
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
        }.items():
            shapes[layer + name] = shape
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _checkpoint(directory: Path, shards: dict[str, dict[str, np.ndarray]]) -> Path:
    """Writes tiny's ``config.json`` and the ``shards`` (file -> tensors); an index when
    there are several."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(TINY))
    for file, tensors in shards.items():
        save_file(tensors, str(directory / file))
    if len(shards) > 1:
        weight_map = {n: file for file, tensors in shards.items() for n in tensors}
        index = {"metadata": {}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length])


def _cut(root: Path) -> tuple[Path, list[str]]:
    """A checkpoint whose file lost its last 4 bytes: the words its refusal must hold."""
    directory = _checkpoint(root / "cut", {"model.safetensors": _tensors()})
    path = directory / "model.safetensors"
    header = {k: v for k, v in _header(path).items() if k != "__metadata__"}
    last = max(header, key=lambda name: header[name]["data_offsets"][1])
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 4)
    return directory, [f"{path}: truncated: tensor {last!r}"]


def _flipped(root: Path) -> tuple[Path, list[str]]:
    """A bit flipped in a header: an entry's shape no longer fits its bytes."""
    directory = _checkpoint(root / "flipped", {"model.safetensors": _tensors()})
    path = directory / "model.safetensors"
    raw = path.read_bytes()
    assert raw.count(b'"shape":[64,128]') == 2  # the two down_proj weights
    path.write_bytes(raw.replace(b'"shape":[64,128]', b'"shape":[64,129]', 1))
    down = next(name for name, e in _header(path).items() if e.get("shape") == [64, 129])
    return directory, [f"{path}: corrupt header entry for tensor {down!r}", "shape [64, 129]"]


def _no_shard(root: Path) -> tuple[Path, list[str]]:
    """Two shards and their index; the second shard is gone."""
    tensors = _tensors()
    second = {n: t for n, t in tensors.items() if n.startswith("model.layers.1.")}
    first = {n: t for n, t in tensors.items() if n not in second}
    files = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    directory = _checkpoint(root / "no_shard", files)
    (directory / "model-00002-of-00002.safetensors").unlink()
    return directory, [
        f"{directory / 'model-00002-of-00002.safetensors'}: shard named by "
        "model.safetensors.index.json is missing",
        f"the index puts {len(second)} tensors in it, e.g. ['model.layers.1.",
    ]


def _wider(root: Path) -> tuple[Path, list[str]]:
    """config.json says tiny; the MLP tensors were saved from a model twice as wide."""
    directory = _checkpoint(root / "wider", {"model.safetensors": _tensors(intermediate=256)})
    return directory, [
        f"{directory / 'model.safetensors'}: tensor 'model.layers.0.mlp.gate_proj.weight' has "
        "shape [256, 64], expected [128, 64] from the architecture in config.json"
    ]


@pytest.fixture(scope="module")
def before(shared_tp1) -> bytes:
    """What the shared server answers before any bad weights reached it."""
    with ScoringClient(shared_tp1.target, timeout=120, retries=None) as client:
        return _scored(client)


def _scored(client: ScoringClient) -> bytes:
    """Every number of one Score, as raw bytes (with the weights version)."""
    result = client.score(SEQUENCES, top_k=4)
    assert result.weights_version == WEIGHTS
    arrays = [*result.logprobs, *result.top_k_ids, *result.top_k_logprobs]
    return b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)


@pytest.mark.parametrize("damage", [_cut, _flipped, _no_shard, _wider])
def test_load_weights_of_a_damaged_checkpoint_names_file_and_tensor(tp1, before, tmp_path, damage):
    directory, words = damage(tmp_path)
    with ScoringClient(tp1.target, timeout=120, retries=None) as client:
        with pytest.raises(ScoringError) as refused:
            client.load_weights(f"hf:{directory}")
        assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION, refused.value
        details = refused.value.details
        for word in [*words, f"still serving weights {WEIGHTS!r}"]:
            assert word in details, (word, details)
        assert client.model_info().weights_version == WEIGHTS
        assert _scored(client) == before


def _begin(**fields) -> pb.UpdateWeightsRequest:
    return pb.UpdateWeightsRequest(begin=pb.UpdateWeightsBegin(names=pb.WEIGHT_NAMES_HF, **fields))


def _chunk(name, values: np.ndarray, dtype=pb.DTYPE_FLOAT32, shape=None, indices=None):
    chunk = pb.TensorChunk(
        name=name,
        shape=values.shape if shape is None else shape,
        data=pb.Array(dtype=dtype, data=values.tobytes()),
    )
    if indices is not None:
        chunk.indices.CopyFrom(pb.Array(dtype=pb.DTYPE_INT32, data=indices.tobytes()))
    return pb.UpdateWeightsRequest(chunk=chunk)


def _commit(**fields) -> pb.UpdateWeightsRequest:
    return pb.UpdateWeightsRequest(commit=pb.UpdateWeightsCommit(**fields))


def _refused(server, messages, words: list[str]) -> None:
    """The push is refused INVALID_ARGUMENT with ``words`` in its message."""
    with pytest.raises(grpc.RpcError) as refused:
        server.stub().UpdateWeights(iter(messages), timeout=60)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, refused.value
    for word in words:
        assert word in refused.value.details(), (word, refused.value.details())


def test_a_push_of_the_wrong_shape_or_dtype_names_the_tensor(tp1, before):
    down = "model.layers.0.mlp.down_proj.weight"
    _refused(
        tp1,
        [_begin(), _chunk(NORM, np.ones(32, np.float32)), _commit(partial=True)],
        [f"message 1, tensor {NORM!r}: shape [32], the served model's is [64]"],
    )
    as_ints = _chunk(down, np.zeros((64, 128), np.int32), dtype=pb.DTYPE_INT32)
    _refused(
        tp1,
        [_begin(), as_ints, _commit(partial=True)],
        [f"message 1, tensor {down!r}: dtype DTYPE_INT32 not accepted"],
    )
    with ScoringClient(tp1.target, timeout=120, retries=None) as client:
        assert _scored(client) == before


def test_a_delta_of_the_wrong_shape_or_dtype_names_the_tensor(tp1, before):
    # A copy to patch: the norm's own values (ones), kept under the version served, so
    # nothing a client sees changes.
    kept = [_begin(keep=True), _chunk(NORM, np.ones(64, np.float32))]
    kept.append(_commit(weights_version=WEIGHTS, partial=True))
    assert tp1.stub().UpdateWeights(iter(kept), timeout=60).weights_version == WEIGHTS
    index = np.array([3], np.int32)
    patches = {
        "bf16 values for a float32 copy": (
            _chunk(NORM, np.ones(1, np.uint16), pb.DTYPE_BFLOAT16, shape=(64,), indices=index),
            [f"message 1, tensor {NORM!r}: a patch needs", "(kept: DTYPE_FLOAT32 [64])"],
        ),
        "another shape": (
            _chunk(NORM, np.ones(1, np.float32), shape=(65,), indices=index),
            [f"message 1, tensor {NORM!r}: shape [65], the served model's is [64]"],
        ),
        "a whole tensor of another shape": (
            _chunk(NORM, np.ones(65, np.float32)),
            [f"message 1, tensor {NORM!r}: shape [65], the served model's is [64]"],
        ),
    }
    for patch, words in patches.values():
        _refused(tp1, [_begin(base_weights_version=WEIGHTS), patch, _commit()], words)
    with ScoringClient(tp1.target, timeout=120, retries=None) as client:
        assert _scored(client) == before
    # the kept copy is still there: a good delta against it is taken
    good = _chunk(NORM, np.ones(1, np.float32), shape=(64,), indices=index)
    answer = tp1.stub().UpdateWeights(
        iter([_begin(base_weights_version=WEIGHTS), good, _commit(weights_version=WEIGHTS)]),
        timeout=60,
    )
    assert answer.weights_version == WEIGHTS and answer.num_tensors == 1
    with ScoringClient(tp1.target, timeout=120, retries=None) as client:
        assert _scored(client) == before


def test_start_up_on_a_cut_file_exits_naming_file_and_tensor(serve, tmp_path):
    directory, words = _cut(tmp_path)
    server = serve("--model", f"hf:{directory}")
    assert server.wait(timeout=120) == 1  # the engine failed to build (server/README.md)
    log = server.output()
    for word in words:
        assert word in log, (word, log)
    assert "SERVING" not in server.health_seen

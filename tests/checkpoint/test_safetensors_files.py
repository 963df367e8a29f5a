"""Damaged safetensors files and indexes are refused before any tensor is read, each with a
CheckpointError that names the file and the tensor (``megascore.checkpoint.safetensors_files``
and the reader on top of it). No model is built here: the loaders' own checks (a tensor of
another shape than the config implies) are in ``test_hf_convert.py``."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from megascore.api.errors import CheckpointError
from megascore.checkpoint.safetensors_files import INDEX_FILE, read_header, weight_files
from megascore.checkpoint.safetensors_io import SafetensorsDir

TENSORS = {  # 96 + 32 + 24 bytes of data, in this order in the file
    "a.weight": np.arange(24, dtype=np.float32).reshape(4, 6),
    "b.weight": np.ones(8, dtype=np.float32),
    "c.bias": np.zeros((2, 3), dtype=np.float32),
}


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path: Path, header, data: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


@pytest.fixture
def good(tmp_path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(TENSORS, str(path), metadata={"format": "pt"})
    return path


def test_a_file_safetensors_wrote_passes_with_every_entry(good, tmp_path):
    header, start = read_header(good)
    assert sorted(header) == sorted(TENSORS)
    assert start == good.stat().st_size - sum(t.nbytes for t in TENSORS.values())
    empty = tmp_path / "empty"
    empty.mkdir()
    save_file({"e": np.zeros((0, 4), np.float32), **TENSORS}, str(empty / "model.safetensors"))
    with SafetensorsDir(empty) as reader:  # a zero-size tensor takes no bytes, and reads
        assert reader.read("e").shape == (0, 4)
        assert reader.read("b.weight").tolist() == [1.0] * 8


def _edit(entry: str, **fields):
    def edit(header, data):
        header[entry] = {**header[entry], **fields}
        return header, data

    return edit


def _replace(entry: str, value):
    def edit(header, data):
        header[entry] = value
        return header, data

    return edit


# case -> (edit(header, data) -> (header, data), substrings of the message after the path)
HEADER_CASES = {
    "entry not an object": (_replace("b.weight", [1, 2]), ["tensor 'b.weight'", "not an object"]),
    "no data_offsets": (
        lambda h, d: ({**h, "b.weight": {"dtype": "F32", "shape": [8]}}, d),
        ["tensor 'b.weight'", "data_offsets None"],
    ),
    "unknown dtype": (_edit("a.weight", dtype="Q7"), ["tensor 'a.weight'", "dtype 'Q7'"]),
    "shape not sizes": (_edit("a.weight", shape=[4, "6"]), ["tensor 'a.weight'", "shape [4, '6']"]),
    "negative offset": (
        _edit("b.weight", data_offsets=[-32, 0]),
        ["tensor 'b.weight'", "data_offsets [-32, 0]"],
    ),
    "size of another shape": (
        _edit("a.weight", shape=[4, 5]),
        ["tensor 'a.weight'", "96 bytes for shape [4, 5] F32"],
    ),
    "two tensors on the same bytes": (
        _edit("c.bias", shape=[8], data_offsets=[96, 128]),
        ["tensor 'c.bias' at bytes [96, 128)", "overlaps the tensor before it ('b.weight')"],
    ),
    "a hole": (
        lambda h, d: ({**h, "b.weight": {**h["b.weight"], "data_offsets": [100, 132]}}, d),
        ["tensor 'b.weight' at bytes [100, 132)", "leaves bytes [96, 100) after"],
    ),
    "bytes after the last tensor": (
        lambda h, d: (h, d + b"junk"),
        ["4 bytes after the data of its last tensor ('c.bias')", "152 of the 156"],
    ),
    "cut in a tensor": (
        lambda h, d: (h, d[:100]),
        ["truncated: tensor 'b.weight' needs bytes [96, 128)", "holds only 100"],
    ),
}


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_a_damaged_header_names_the_file_and_the_tensor(good, case):
    edit, words = HEADER_CASES[case]
    _write(good, *edit(*_header(good)))
    with pytest.raises(CheckpointError) as error:
        SafetensorsDir(good.parent)
    assert error.value.reason.startswith(f"{good}: "), error.value.reason
    for word in words:
        assert word in error.value.reason, (word, error.value.reason)


@pytest.mark.parametrize(
    "content, words",
    [
        (b"\x01\x00", "truncated safetensors file (2 bytes)"),
        (struct.pack("<Q", 4096) + b'{"a": 1}', "header length 4096, file size 16"),
        (struct.pack("<Q", 6) + b"{nope}", "corrupt safetensors header: Expecting"),
        (struct.pack("<Q", 2) + b"[]", "corrupt safetensors header (not an object)"),
        (b"version https://git-lfs.github.com/spec/v1\noid sha256:0\n", "Git LFS pointer"),
    ],
    ids=["shorter than its length field", "cut in the header", "not JSON", "a list", "LFS"],
)
def test_a_file_that_is_not_safetensors_names_the_file(tmp_path, content, words):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as error:
        read_header(path)
    assert error.value.reason.startswith(f"{path}: ") and words in error.value.reason


def _sharded(directory: Path) -> dict[str, str]:
    """Writes TENSORS as two shards and their index; returns the index's weight map."""
    directory.mkdir()
    shards = {"model-1.safetensors": ["a.weight"], "model-2.safetensors": ["b.weight", "c.bias"]}
    weight_map = {}
    for file, names in shards.items():
        save_file({n: TENSORS[n] for n in names}, str(directory / file))
        weight_map |= dict.fromkeys(names, file)
    (directory / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    return weight_map


def test_an_index_naming_a_missing_file_names_it_and_its_tensors(tmp_path):
    directory = tmp_path / "sharded"
    _sharded(directory)
    files, indexed = weight_files(directory)
    assert [f.name for f in files] == ["model-1.safetensors", "model-2.safetensors"]
    assert indexed["c.bias"] == directory / "model-2.safetensors"
    (directory / "model-2.safetensors").unlink()
    with pytest.raises(CheckpointError) as error:
        SafetensorsDir(directory)
    assert error.value.reason == (
        f"{directory / 'model-2.safetensors'}: shard named by {INDEX_FILE} is missing (the "
        "index puts 2 tensors in it, e.g. ['b.weight', 'c.bias'])"
    )
    (directory / "model-1.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-1\.safetensors: .*'a\.weight'.*1 more"):
        weight_files(directory)


def test_an_index_out_of_step_with_its_files_names_the_file_it_claims(tmp_path):
    directory = tmp_path / "sharded"
    weight_map = _sharded(directory)
    weight_map["d.weight"] = "model-1.safetensors"  # a tensor no shard holds
    (directory / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with SafetensorsDir(directory) as reader:
        assert reader.file("c.bias") == directory / "model-2.safetensors"
        with pytest.raises(CheckpointError) as error:
            reader.shape("d.weight")
    assert error.value.reason == (
        f"{directory / 'model-1.safetensors'}: missing tensor 'd.weight', which {INDEX_FILE} "
        "puts in this file"
    )


@pytest.mark.parametrize(
    "index, words",
    [
        ("{", "corrupt index: Expecting"),
        ('{"metadata": {}}', "corrupt index: 'weight_map'"),
        ('{"weight_map": ["a.weight"]}', "corrupt index: weight_map is not an object"),
        ('{"weight_map": {"a.weight": 3}}', "corrupt index: weight_map is not an object"),
    ],
)
def test_a_corrupt_index_names_it(tmp_path, index, words):
    directory = tmp_path / "sharded"
    _sharded(directory)
    (directory / INDEX_FILE).write_text(index)
    with pytest.raises(CheckpointError) as error:
        weight_files(directory)
    assert error.value.reason.startswith(f"{directory / INDEX_FILE}: {words}")

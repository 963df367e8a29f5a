"""The files of a safetensors checkpoint and their headers, checked before any tensor is read.

Torch-free; :class:`megascore.checkpoint.safetensors_io.SafetensorsDir` reads through it.
:func:`weight_files` finds a directory's weight files (``model.safetensors``, the shards a
``model.safetensors.index.json`` names, else every ``*.safetensors``); :func:`read_header`
parses one file's header and checks it as safetensors itself does: every entry a known
dtype, a shape and a byte span of that size, the spans tiling the data section exactly
(no overlap, no hole, nothing after the last one) and inside the file (a truncated
download is reported with the first tensor it cuts off). Every error is a
:class:`~megascore.api.errors.CheckpointError` that names the file, and the tensor where
one is concerned.
"""

from __future__ import annotations

import collections
import json
import math
import struct
from pathlib import Path
from typing import Any

from megascore.api.errors import CheckpointError, clip

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
"""Bytes per element of the safetensors dtypes megascore knows."""
# The header is a few kB to a few MB; anything larger is a corrupt length field.
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_LFS_POINTER = b"version https://git-lfs"  # what a clone without `git lfs pull` holds

Header = dict[str, dict[str, Any]]
"""Tensor name -> ``{"dtype", "shape", "data_offsets"}`` of one file."""


def read_header(path: Path) -> tuple[Header, int]:
    """Parses and checks one file's header.

    Returns:
        ``(name -> {dtype, shape, data_offsets}, file offset of the data section)``.

    Raises:
        CheckpointError: the file cannot be read, its header does not parse, an entry is
            malformed, the entries do not tile the data section, or the file ends before
            a tensor's last byte (naming that tensor).
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(len(_LFS_POINTER))
            if head == _LFS_POINTER:
                raise CheckpointError(
                    f"{path}: a Git LFS pointer file, not the weights (fetch them: git lfs pull)"
                )
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes)")
            (header_len,) = struct.unpack("<Q", head[:8])
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors header "
                    f"(header length {header_len}, file size {size})"
                )
            f.seek(8)
            header = json.loads(f.read(header_len))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not an object)")
    header.pop("__metadata__", None)
    _check_spans(path, header, size - 8 - header_len)
    return header, 8 + header_len


def _check_spans(path: Path, header: dict, data_bytes: int) -> None:
    """Raises unless the entries' byte spans tile ``[0, data_bytes)`` in order."""
    spans = sorted((*_entry_span(path, name, info), name) for name, info in header.items())
    position, last = 0, None
    for begin, end, name in spans:
        if end > data_bytes:
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} needs bytes [{begin}, {end}) of the data "
                f"section but the file holds only {data_bytes}"
            )
        if begin != position:
            what = "overlaps" if begin < position else f"leaves bytes [{position}, {begin}) after"
            raise CheckpointError(
                f"{path}: corrupt header: tensor {name!r} at bytes [{begin}, {end}) of the data "
                f"section {what} the tensor before it ({last!r})"
            )
        position, last = end, name
    if position != data_bytes:
        raise CheckpointError(
            f"{path}: corrupt: {data_bytes - position} bytes after the data of its last "
            f"tensor ({last!r}); the header describes {position} of the {data_bytes}"
        )


def _entry_span(path: Path, name: str, info: Any) -> tuple[int, int]:
    """``(begin, end)`` of one header entry, checked against its dtype and shape."""
    where = f"{path}: corrupt header entry for tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: {clip(repr(info))}, not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{where}: dtype {clip(repr(dtype))} (known: {list(DTYPE_BYTES)})")
    if not _sizes(shape):
        raise CheckpointError(f"{where}: shape {clip(repr(shape))}, not a list of sizes")
    if not (_sizes(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: data_offsets {clip(repr(offsets))}, not [begin, end]")
    begin, end = offsets
    if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise CheckpointError(f"{where}: {end - begin} bytes for shape {shape} {dtype}")
    return begin, end


def _sizes(value: Any) -> bool:
    """``value`` is a list of non-negative ints."""
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)  # no bools


def weight_files(directory: Path) -> tuple[list[Path], dict[str, Path]]:
    """The weight files of ``directory``, and the file its index names for each tensor.

    Returns:
        ``(files, tensor name -> file)``: the files the index names, ``model.safetensors``,
        or every ``*.safetensors``; the map is empty without an index.

    Raises:
        CheckpointError: no safetensors weights, a corrupt index, or a file the index names
            missing (naming it and the tensors the index puts in it).
    """
    index = directory / INDEX_FILE
    if index.is_file():
        indexed = _read_index(index)
        missing = collections.defaultdict(list)
        for name, path in indexed.items():
            if not path.is_file():
                missing[path].append(name)
        if missing:
            path, names = min(missing.items())
            more = f"; {len(missing) - 1} more of its files missing" if len(missing) > 1 else ""
            raise CheckpointError(
                f"{path}: shard named by {INDEX_FILE} is missing (the index puts "
                f"{len(names)} tensors in it, e.g. {sorted(names)[:3]}){more}"
            )
        return sorted(set(indexed.values())), indexed
    single = directory / SINGLE_FILE
    if single.is_file():
        return [single], {}
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files, {}
    hint = " (PyTorch .bin weights are not supported)" if any(directory.glob("*.bin")) else ""
    raise CheckpointError(f"{directory}: no safetensors weights found{hint}")


def _read_index(index: Path) -> dict[str, Path]:
    """Tensor name -> the file ``index`` puts it in."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: corrupt index: {e}") from e
    if not isinstance(weight_map, dict) or not all(
        isinstance(f, str) and f for f in weight_map.values()
    ):
        raise CheckpointError(
            f"{index}: corrupt index: weight_map is not an object of tensor name -> file name"
        )
    return {name: index.parent / file for name, file in weight_map.items()}

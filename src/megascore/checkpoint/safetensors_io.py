"""Streaming, validated access to a directory of ``.safetensors`` files.

:class:`SafetensorsDir` resolves tensor names to files (``model.safetensors`` or a
sharded ``model.safetensors.index.json``), checks every file header against the
file size *before* any data is read (a truncated download is reported with the
first tensor it cuts off), and reads *slices* of tensors through safetensors'
``get_slice`` so that a tensor-parallel rank touches only the bytes of its own
shard (the files are memory-mapped; nothing else is materialised).
"""

from __future__ import annotations

import json
import logging
import math
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from megascore.errors import CheckpointError

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPE_BYTES = {
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
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# The header is a few kB to a few MB; anything larger is a corrupt length field.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def _read_header(path: Path) -> dict[str, dict[str, Any]]:
    """Parses and validates one file's header; returns name -> {dtype, shape, data_offsets}."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors header "
                    f"(header length {header_len}, file size {size})"
                )
            header = json.loads(f.read(header_len))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not an object)")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - header_len
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][1]):
        begin, end = info["data_offsets"]
        nbytes = math.prod(info["shape"]) * _DTYPE_BYTES.get(info["dtype"], 0)
        if end - begin != nbytes:
            raise CheckpointError(
                f"{path}: corrupt header entry for tensor {name!r}: {end - begin} bytes for "
                f"shape {info['shape']} {info['dtype']}"
            )
        if end > data_bytes:
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} needs bytes [{begin}, {end}) of the data "
                f"section but the file holds only {data_bytes}"
            )
    return header


class SafetensorsDir:
    """A HF checkpoint's safetensors files, indexed by tensor name.

    Args:
        directory: the checkpoint directory.

    Raises:
        CheckpointError: no safetensors weights, a broken index, a file named by the
            index missing, or a corrupt / truncated file.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._file_of: dict[str, Path] = {}
        self._info: dict[str, dict[str, Any]] = {}
        self._handles: dict[Path, Any] = {}
        self.files = self._resolve_files()
        for path in self.files:
            for name, info in _read_header(path).items():
                if name in self._info:
                    raise CheckpointError(f"{path}: tensor {name!r} also in {self._file_of[name]}")
                self._info[name] = info
                self._file_of[name] = path
        logger.debug("%s: %d tensors in %d files", directory, len(self._info), len(self.files))

    def _resolve_files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: corrupt index: {e}") from e
            files = sorted({self.directory / f for f in weight_map.values()})
            for path in files:
                if not path.is_file():
                    raise CheckpointError(f"{path}: shard named by {INDEX_FILE} is missing")
            return files
        single = self.directory / SINGLE_FILE
        if single.is_file():
            return [single]
        files = sorted(self.directory.glob("*.safetensors"))
        if files:
            return files
        hint = (
            " (PyTorch .bin weights are not supported)" if any(self.directory.glob("*.bin")) else ""
        )
        raise CheckpointError(f"{self.directory}: no safetensors weights found{hint}")

    # --- metadata (no data read) ---

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def names(self) -> list[str]:
        return sorted(self._info)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` from the header."""
        return tuple(self._entry(name)["shape"])

    def dtype(self, name: str) -> str:
        """Safetensors dtype string of ``name`` (``"BF16"``, ``"F32"`` ...)."""
        return self._entry(name)["dtype"]

    def _entry(self, name: str) -> dict[str, Any]:
        if name not in self._info:
            raise CheckpointError(f"{self.directory}: missing tensor {name!r}")
        return self._info[name]

    # --- data ---

    def read(self, name: str, index: tuple[slice | int, ...] = ()) -> torch.Tensor:
        """Reads ``tensor[index]`` without materialising the rest of the tensor.

        Args:
            name: tensor name.
            index: basic indexing (ints and step-1 slices), one per leading dim.

        Returns:
            A CPU tensor in the file's dtype.
        """
        entry = self._entry(name)
        if entry["dtype"] not in _FLOAT_DTYPES:
            raise CheckpointError(
                f"{self._file_of[name]}: tensor {name!r} has dtype "
                f"{entry['dtype']}, expected a float type"
            )
        path = self._file_of[name]
        try:
            handle = self._handles.get(path)
            if handle is None:
                handle = self._handles[path] = safe_open(str(path), framework="pt")
            sl = handle.get_slice(name)
            out = sl[index] if index else sl[:]
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own SafetensorError types
            raise CheckpointError(f"{path}: cannot read tensor {name!r}: {e}") from e
        return out

    def close(self) -> None:
        """Releases the memory maps."""
        self._handles.clear()

    def __enter__(self) -> SafetensorsDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def fingerprint(self) -> list[tuple[str, int, int]]:
        """(file name, size, mtime_ns) of every weight file, for weights versioning."""
        out = []
        for path in self.files:
            st = path.stat()
            out.append((path.name, st.st_size, st.st_mtime_ns))
        return out

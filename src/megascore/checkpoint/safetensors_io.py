"""Streaming, validated access to a directory of ``.safetensors`` files.

:class:`SafetensorsDir` resolves tensor names to files (``model.safetensors`` or a
sharded ``model.safetensors.index.json``), checks every file header *before* any data
is read (:mod:`megascore.checkpoint.safetensors_files`: a truncated download is reported
with the first tensor it cuts off, a corrupt header with the entry), and reads *slices*
of tensors with plain positioned reads of the byte span that holds them: a
tensor-parallel rank reads only the rows of its own shard (a column slice reads the rows
it spans, then keeps its columns). The files are not memory-mapped: the read pages stay
in the page cache, not in the process's resident memory, so a load's peak RSS is the
model plus the shard in flight.

Block-scaled FP8 tensors (DeepSeek-V3's ``F8_E4M3`` weights with ``weight_scale_inv``,
``megascore.checkpoint.fp8``) read as float32 real values: the slice of the FP8
tensor and of the scale blocks covering it, multiplied. Their ``*_scale_inv`` partners
belong to them (not listed by :meth:`SafetensorsDir.names`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, BinaryIO

import torch

from megascore.api.errors import CheckpointError
from megascore.checkpoint import fp8
from megascore.checkpoint.safetensors_files import INDEX_FILE, read_header, weight_files

logger = logging.getLogger(__name__)

_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsDir:
    """A HF checkpoint's safetensors files, indexed by tensor name.

    Args:
        directory: the checkpoint directory.
        fp8_block: the FP8 block size of a block-scaled checkpoint
            (:func:`megascore.checkpoint.fp8.block_size` of its ``config.json``).

    Raises:
        CheckpointError: naming the file (and the tensor): no safetensors weights, a
            broken index, a file named by the index missing, a corrupt / truncated file
            (:mod:`megascore.checkpoint.safetensors_files`), a tensor in two files, or an
            FP8 tensor whose ``*_scale_inv`` is missing or has another shape than its blocks.
    """

    def __init__(self, directory: str | Path, fp8_block: tuple[int, int] | None = None):
        self.directory = Path(directory)
        self.fp8_block = fp8_block
        self._file_of: dict[str, Path] = {}
        self._info: dict[str, dict[str, Any]] = {}
        self._data_start: dict[Path, int] = {}
        self._handles: dict[Path, BinaryIO] = {}
        self.files, self._indexed = weight_files(self.directory)
        for path in self.files:
            header, self._data_start[path] = read_header(path)
            for name, info in header.items():
                if name in self._info:
                    raise CheckpointError(f"{path}: tensor {name!r} also in {self._file_of[name]}")
                self._info[name] = info
                self._file_of[name] = path
        if fp8_block is not None:
            self._check_fp8_scales(fp8_block)
        logger.debug("%s: %d tensors in %d files", directory, len(self._info), len(self.files))

    def _check_fp8_scales(self, block: tuple[int, int]) -> None:
        for name, info in self._info.items():
            if info["dtype"] not in fp8.FP8_DTYPES:
                continue
            scale = name + fp8.SCALE_SUFFIX
            want = fp8.scale_shape(tuple(info["shape"]), block)
            path = self._file_of[name]
            if len(info["shape"]) < 2:
                raise CheckpointError(f"{path}: FP8 tensor {name!r} is not a matrix")
            if scale not in self._info:
                raise CheckpointError(f"{path}: FP8 tensor {name!r} has no {scale!r}")
            if tuple(self._info[scale]["shape"]) != want:
                raise CheckpointError(
                    f"{self._file_of[scale]}: {scale!r} has shape {self._info[scale]['shape']}, "
                    f"expected {list(want)} ({name!r} {info['shape']} in {list(block)} blocks)"
                )

    # --- metadata (no data read) ---

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def names(self) -> list[str]:
        """Tensor names, without the ``*_scale_inv`` partners of FP8 tensors."""
        scales = {n + fp8.SCALE_SUFFIX for n, i in self._info.items() if self._is_fp8(i)}
        return sorted(n for n in self._info if n not in scales)

    @staticmethod
    def _is_fp8(entry: dict[str, Any]) -> bool:
        return entry["dtype"] in fp8.FP8_DTYPES

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` from the header."""
        return tuple(self._entry(name)["shape"])

    def dtype(self, name: str) -> str:
        """Safetensors dtype string of ``name`` (``"BF16"``, ``"F32"`` ...)."""
        return self._entry(name)["dtype"]

    def file(self, name: str) -> Path:
        """The file that holds tensor ``name``."""
        self._entry(name)
        return self._file_of[name]

    def _entry(self, name: str) -> dict[str, Any]:
        if name in self._info:
            return self._info[name]
        claimed = self._indexed.get(name)
        if claimed is not None:  # an index out of step with its shards (a mixed download)
            raise CheckpointError(
                f"{claimed}: missing tensor {name!r}, which {INDEX_FILE} puts in this file"
            )
        raise CheckpointError(f"{self.directory}: missing tensor {name!r}")

    # --- data ---

    def read(self, name: str, index: tuple[slice | int, ...] = ()) -> torch.Tensor:
        """Reads ``tensor[index]``, reading only the byte span that holds it.

        Args:
            name: tensor name.
            index: basic indexing (ints and step-1 slices), one per leading dim.

        Returns:
            A new CPU tensor in the file's dtype (an FP8 tensor: its real values in float32).
        """
        entry = self._entry(name)
        if self._is_fp8(entry):
            return self._read_fp8(name, entry, index)
        if entry["dtype"] not in _FLOAT_DTYPES:
            raise CheckpointError(
                f"{self._file_of[name]}: tensor {name!r} has dtype "
                f"{entry['dtype']}, expected a float type"
            )
        return self._read_raw(name, index)

    def _read_fp8(
        self, name: str, entry: dict[str, Any], index: tuple[slice | int, ...]
    ) -> torch.Tensor:
        """``tensor[index]`` of a block-scaled FP8 tensor, dequantised (float32)."""
        if self.fp8_block is None:
            raise CheckpointError(
                f"{self._file_of[name]}: tensor {name!r} is {entry['dtype']} but config.json "
                "has no quantization_config (weight_block_size)"
            )
        shape = entry["shape"]
        full: list[slice] = []
        squeeze: list[int] = []
        for dim, size in enumerate(shape):
            i = index[dim] if dim < len(index) else slice(None)
            if isinstance(i, int):
                squeeze.append(dim)
                i = slice(i, i + 1)
            start, stop, _ = i.indices(size)
            full.append(slice(start, stop))
        scale_idx, offset = fp8.scale_index(tuple(full), self.fp8_block)
        values = self._read_raw(name, tuple(full))
        scales = self._read_raw(name + fp8.SCALE_SUFFIX, scale_idx)
        out = fp8.dequantize(values, scales, self.fp8_block, offset)
        for dim in reversed(squeeze):
            out = out.squeeze(dim)
        return out

    def _read_raw(self, name: str, index: tuple[slice | int, ...]) -> torch.Tensor:
        dtype, span, sizes, squeeze = self._locate(name, index)
        out = torch.empty(span[1] - span[0], dtype=dtype)
        self._read_span(name, span[0], out)
        view = out.as_strided(sizes, _contiguous_strides(self._info[name]["shape"]))
        if view.numel() != out.numel():  # a column slice: keep only its columns
            view = view.contiguous()
        return view.reshape([n for n, drop in zip(sizes, squeeze, strict=True) if not drop])

    def read_into(self, name: str, out: torch.Tensor, index: tuple[slice | int, ...] = ()) -> None:
        """Writes ``tensor[index]`` into ``out`` (a tensor of its shape, e.g. a parameter).

        The file's bytes go straight into ``out``'s memory when ``out`` is a contiguous
        CPU tensor in the file's dtype and the selection is one contiguous span of the
        file (whole tensors, row ranges); otherwise through :meth:`read` and a copy that
        converts the dtype (and moves the data to ``out``'s device).
        """
        if self._entry(name)["dtype"] in _FLOAT_DTYPES:
            dtype, span, sizes, squeeze = self._locate(name, index)
            shape = [n for n, drop in zip(sizes, squeeze, strict=True) if not drop]
            direct = dtype == out.dtype and out.device.type == "cpu" and out.is_contiguous()
            if direct and list(out.shape) == shape and span[1] - span[0] == out.numel():
                self._read_span(name, span[0], out.detach())
                return
        out.copy_(self.read(name, index))

    def _locate(self, name: str, index) -> tuple[torch.dtype, tuple[int, int], list, list]:
        """``(dtype, element span, sizes, dropped dims)`` of ``tensor[index]`` (:func:`_span`)."""
        entry = self._entry(name)
        try:
            return (_TORCH_DTYPES[entry["dtype"]], *_span(entry["shape"], index))
        except (IndexError, ValueError) as e:
            raise CheckpointError(f"{self._file_of[name]}: cannot read {name!r}: {e}") from e

    def _read_span(self, name: str, first: int, out: torch.Tensor) -> None:
        """Fills ``out`` with tensor ``name``'s bytes from element ``first`` on (positioned
        reads, no mmap)."""
        path = self._file_of[name]
        offset = self._data_start[path] + self._info[name]["data_offsets"][0]
        offset += first * out.element_size()
        buf = memoryview(out.view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        done = 0
        try:
            handle = self._handles.get(path)
            if handle is None:
                handle = self._handles[path] = open(path, "rb", buffering=0)  # noqa: SIM115
            while done < len(buf):
                n = os.preadv(handle.fileno(), [buf[done:]], offset + done)
                if not n:
                    raise OSError(f"file ends before byte {offset + len(buf)}")
                done += n
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read tensor {name!r}: {e}") from e

    def close(self) -> None:
        """Closes the files."""
        for handle in self._handles.values():
            handle.close()
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


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return strides[::-1]


def _span(
    shape: list[int], index: tuple[slice | int, ...]
) -> tuple[tuple[int, int], list[int], list[bool]]:
    """The elements ``tensor[index]`` lies in, for a contiguous tensor of ``shape``.

    Returns:
        ``((first, stop) span of flat element indices, from the selection's first element
        to its last; the selection's size per dim; which dims an int index drops)``.
    """
    if len(index) > len(shape):
        raise IndexError(f"{len(index)} indices for a {len(shape)}-d tensor")
    strides = _contiguous_strides(shape)
    starts, sizes, squeeze = [], [], []
    for dim, n in enumerate(shape):
        ix = index[dim] if dim < len(index) else slice(None)
        if isinstance(ix, int):
            ix = ix + n if ix < 0 else ix
            if not 0 <= ix < n:
                raise IndexError(f"index {ix} out of range for dim {dim} of size {n}")
            start, stop, drop = ix, ix + 1, True
        else:
            start, stop, step = ix.indices(n)
            if step != 1:
                raise ValueError(f"slice step {step} (only step 1)")
            stop, drop = max(start, stop), False
        starts.append(start)
        sizes.append(stop - start)
        squeeze.append(drop)
    if 0 in sizes:
        return (0, 0), sizes, squeeze
    first = sum(s * st for s, st in zip(starts, strides, strict=True))
    last = sum((s + k - 1) * st for s, k, st in zip(starts, sizes, strides, strict=True))
    return (first, last + 1), sizes, squeeze

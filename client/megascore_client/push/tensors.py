"""A pushed tensor as raw bytes: :class:`RawTensor` and :func:`to_raw` (numpy arrays, torch
tensors, raw bytes), with the dtypes a push carries. Torch is never imported here until a
torch tensor is given (it is recognised by its type's module, so torch stays optional;
bf16 travels as its raw 2 bytes, numpy having no bf16)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from megascore.v1 import scoring_pb2 as pb
from megascore_client.errors import InvalidInputError

__all__ = ["DTYPES", "RawTensor", "to_raw"]

DTYPES = {  # dtype name -> (proto Dtype, element bytes)
    "float32": (pb.DTYPE_FLOAT32, 4),
    "bfloat16": (pb.DTYPE_BFLOAT16, 2),
    "float16": (pb.DTYPE_FLOAT16, 2),
    "float64": (pb.DTYPE_FLOAT64, 8),
}


@dataclasses.dataclass(frozen=True)
class RawTensor:
    """A tensor as raw little-endian C-order bytes.

    Attributes:
        dtype: "float32", "bfloat16", "float16" or "float64".
        shape: its shape.
        data: ``prod(shape) x element size`` bytes (any buffer: bytes, memoryview, mmap).
    """

    dtype: str
    shape: tuple[int, ...]
    data: object


def to_raw(name: str, tensor) -> RawTensor:
    """A numpy array, torch tensor or :class:`RawTensor` as raw bytes (no float conversion).

    Raises:
        InvalidInputError: another dtype, naming the tensor.
    """
    if isinstance(tensor, RawTensor):
        raw = tensor
    elif type(tensor).__module__.split(".")[0] == "torch":
        raw = _torch_raw(tensor)
    else:
        arr = np.ascontiguousarray(tensor)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        raw = RawTensor(arr.dtype.name, arr.shape, arr.reshape(-1).view(np.uint8).data)
    if raw.dtype not in DTYPES:
        raise InvalidInputError(
            f"tensor {name!r}: dtype {raw.dtype} cannot be pushed (one of {sorted(DTYPES)})"
        )
    size = math.prod(raw.shape) * DTYPES[raw.dtype][1]
    if memoryview(raw.data).nbytes != size:
        raise InvalidInputError(
            f"tensor {name!r}: {memoryview(raw.data).nbytes} bytes for shape {list(raw.shape)}"
            f" in {raw.dtype} ({size} expected)"
        )
    return raw


def _torch_raw(tensor) -> RawTensor:
    """A torch tensor's bytes; torch is already imported (the tensor exists)."""
    import torch

    t = tensor.detach().to("cpu").contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    flat = t.reshape(-1)
    if t.dtype in (torch.bfloat16, torch.float16):
        data = flat.view(torch.int16).numpy().view(np.uint8).data
    else:
        data = flat.numpy().view(np.uint8).data
    return RawTensor(dtype, tuple(t.shape), data)

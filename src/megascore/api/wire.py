"""numpy <-> ``megascore.v1.Array`` codec (torch-free; used by server and client).

Arrays travel as raw little-endian bytes with a declared dtype: decoding is a
zero-copy ``np.frombuffer`` (see bench/wire_format.py for the measurement).
"""

from __future__ import annotations

import numpy as np

from megascore.api.errors import InvalidRequestError
from megascore.v1 import scoring_pb2 as pb

_TO_NUMPY = {
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT64: np.dtype("<f8"),
    pb.DTYPE_UINT8: np.dtype("u1"),
}
_FROM_NUMPY = {v.newbyteorder("<") if v.itemsize > 1 else v: k for k, v in _TO_NUMPY.items()}


def encode_array(values: np.ndarray) -> pb.Array:
    """Encodes a numpy array (any shape, C order) as a flat ``Array``."""
    arr = np.asarray(values)
    dtype = arr.dtype.newbyteorder("<") if arr.dtype.itemsize > 1 else arr.dtype
    if dtype not in _FROM_NUMPY:
        raise TypeError(f"unsupported dtype for the wire: {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=dtype)
    return pb.Array(dtype=_FROM_NUMPY[dtype], data=arr.tobytes())


def decode_array(array: pb.Array, field: str, allowed: tuple[int, ...] | None = None) -> np.ndarray:
    """Decodes an ``Array`` into a read-only flat numpy array.

    Args:
        array: the message.
        field: field name used in error messages.
        allowed: accepted ``Dtype`` values (None = any valid one).

    Raises:
        InvalidRequestError: unknown/unset/disallowed dtype, or a byte length that is
            not a multiple of the element size.
    """
    np_dtype = _TO_NUMPY.get(array.dtype)
    if np_dtype is None or (allowed is not None and array.dtype not in allowed):
        names = ", ".join(pb.Dtype.Name(d) for d in (allowed or tuple(_TO_NUMPY)))
        got = pb.Dtype.Name(array.dtype) if array.dtype in pb.Dtype.values() else array.dtype
        raise InvalidRequestError(f"{field}: dtype {got} not accepted (expected one of {names})")
    if len(array.data) % np_dtype.itemsize:
        raise InvalidRequestError(
            f"{field}: byte length {len(array.data)} is not a multiple of the "
            f"{np_dtype.itemsize}-byte element size of {pb.Dtype.Name(array.dtype)}"
        )
    return np.frombuffer(array.data, dtype=np_dtype)

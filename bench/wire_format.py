"""Micro-benchmark: packed repeated scalars vs raw little-endian bytes on the wire.

For N tokens (default 1M) it times, in Python, the two ways a per-token array can
travel in a protobuf message:

* ``repeated int64`` / ``repeated float`` (proto3 packs them: varints for ints,
  4 bytes per float), filled from numpy and read back into numpy;
* ``megascore.v1.Array``: the raw little-endian bytes with a dtype, through
  ``megascore.api.wire.encode_array`` / ``decode_array`` (a zero-copy ``np.frombuffer``).

"encode" is numpy -> message -> serialized bytes; "decode" is bytes -> message ->
numpy. The packed-repeated messages are built at runtime from a
``FileDescriptorProto``, so no generated code is checked in for them.

Usage: ``python bench/wire_format.py [--tokens N] [--repeats R]``; results and
the decision are recorded in docs/wire.md.
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import time
from collections.abc import Callable

import google.protobuf
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.internal import api_implementation

from megascore.api.wire import decode_array, encode_array
from megascore.v1 import scoring_pb2 as pb

logger = logging.getLogger(__name__)


def _repeated_message_classes() -> tuple[type, type]:
    """Builds ``RepeatedInt64 {repeated int64 values = 1;}`` and a float twin at runtime."""
    fdp = descriptor_pb2.FileDescriptorProto(
        name="megascore_bench/repeated.proto", package="megascore_bench", syntax="proto3"
    )
    label = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
    for name, ftype in (
        ("RepeatedInt64", descriptor_pb2.FieldDescriptorProto.TYPE_INT64),
        ("RepeatedFloat", descriptor_pb2.FieldDescriptorProto.TYPE_FLOAT),
    ):
        msg = fdp.message_type.add(name=name)
        msg.field.add(name="values", number=1, type=ftype, label=label)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return (
        message_factory.GetMessageClass(
            pool.FindMessageTypeByName("megascore_bench.RepeatedInt64")
        ),
        message_factory.GetMessageClass(
            pool.FindMessageTypeByName("megascore_bench.RepeatedFloat")
        ),
    )


def _time(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Median wall time in milliseconds over ``repeats`` runs, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), result


def _bench_repeated(cls: type, values: np.ndarray, dtype: np.dtype, repeats: int) -> dict:
    def encode() -> bytes:
        msg = cls()
        msg.values.extend(values.tolist())
        return msg.SerializeToString()

    def decode(data: bytes) -> np.ndarray:
        msg = cls.FromString(data)
        return np.array(msg.values, dtype=dtype)

    enc_ms, data = _time(encode, repeats)
    dec_ms, out = _time(lambda: decode(data), repeats)
    assert np.array_equal(out, values.astype(dtype)), "repeated round trip changed the values"
    return {"encode_ms": enc_ms, "decode_ms": dec_ms, "bytes": len(data)}


def _bench_raw(values: np.ndarray, allowed: tuple[int, ...], repeats: int) -> dict:
    enc_ms, data = _time(lambda: encode_array(values).SerializeToString(), repeats)
    dec_ms, out = _time(lambda: decode_array(pb.Array.FromString(data), "bench", allowed), repeats)
    assert np.array_equal(out, values), "raw round trip changed the values"
    return {"encode_ms": enc_ms, "decode_ms": dec_ms, "bytes": len(data)}


def run(num_tokens: int, repeats: int, seed: int = 0) -> list[tuple[str, str, dict]]:
    """Runs every variant.

    Args:
        num_tokens: elements per array.
        repeats: timed runs per measurement (the median is reported).
        seed: RNG seed of the synthetic data.

    Returns:
        ``(payload, encoding, {"encode_ms", "decode_ms", "bytes"})`` rows.
    """
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(0, 152_064, size=num_tokens, dtype=np.int64)  # Qwen-size vocab
    logprobs = -rng.exponential(2.0, size=num_tokens).astype(np.float32)
    repeated_int64, repeated_float = _repeated_message_classes()
    return [
        (
            "token ids",
            "repeated int64",
            _bench_repeated(repeated_int64, token_ids, np.int64, repeats),
        ),
        ("token ids", "Array INT64", _bench_raw(token_ids, (pb.DTYPE_INT64,), repeats)),
        (
            "token ids",
            "Array INT32",
            _bench_raw(token_ids.astype(np.int32), (pb.DTYPE_INT32,), repeats),
        ),
        (
            "logprobs",
            "repeated float",
            _bench_repeated(repeated_float, logprobs, np.float32, repeats),
        ),
        ("logprobs", "Array FLOAT32", _bench_raw(logprobs, (pb.DTYPE_FLOAT32,), repeats)),
    ]


def format_table(rows: list[tuple[str, str, dict]]) -> str:
    """Markdown table; ratios are relative to the packed-repeated row of the same payload."""
    baseline = {payload: r for payload, enc, r in rows if enc.startswith("repeated")}
    lines = [
        "| payload | encoding | encode ms | decode ms | MB | encode x | decode x |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for payload, enc, r in rows:
        base = baseline[payload]
        lines.append(
            f"| {payload} | {enc} | {r['encode_ms']:.2f} | {r['decode_ms']:.3f} | "
            f"{r['bytes'] / 1e6:.2f} | {base['encode_ms'] / r['encode_ms']:.1f} | "
            f"{base['decode_ms'] / r['decode_ms']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(
        f"{args.tokens:,} elements, median of {args.repeats}; Python {platform.python_version()}, "
        f"protobuf {google.protobuf.__version__} ({api_implementation.Type()}), "
        f"numpy {np.__version__}\n"
    )
    print(format_table(run(args.tokens, args.repeats)))
    print("\n'x' columns: speed-up over packed repeated for the same payload.")


if __name__ == "__main__":
    main()

"""Weight pushes (``UpdateWeights``): a trainer's named tensors into a running server.

``client.push_weights(named_tensors, weights_version=...)`` streams ``(name, tensor)``
pairs as ``begin``, chunks under the message limit (small tensors several to a message
when the server takes ``chunks``), ``commit``. A tensor is a
numpy array, a torch tensor (torch stays optional; bf16 travels as its raw 2 bytes), or a
:class:`RawTensor` (raw bytes + dtype name, e.g. straight from a safetensors file:
:func:`read_safetensors`); their encoding is ``megascore_client.push.tensors``, each
tensor's messages (chunks, a delta's patches, packs) ``megascore_client.push.packing``.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

from megascore.v1 import scoring_pb2 as pb
from megascore_client.errors import InvalidInputError
from megascore_client.push.packing import WHOLE, Pack, Progress, delta_chunk, tensor_messages
from megascore_client.push.tensors import RawTensor, to_raw

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "ElapsedLine",
    "PUSH_TIMEOUT_S",
    "ProgressBar",
    "PushResult",
    "RawTensor",
    "add_cli_arguments",
    "chunk_size",
    "finish",
    "push_requests",
    "read_safetensors",
    "run_cli",
    "to_raw",
    "total_bytes",
]

PUSH_TIMEOUT_S = 1800.0
DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024
_CHUNK_HEADROOM = 64 * 1024  # name, shape and framing around a chunk's bytes
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
_NAMES = {
    "hf": pb.WEIGHT_NAMES_HF,
    "megatron": pb.WEIGHT_NAMES_MEGATRON,
    "peft": pb.WEIGHT_NAMES_PEFT,
}


@dataclasses.dataclass
class PushResult:
    """Outcome of a successful ``push_weights``.

    Attributes:
        weights_version: the version now serving.
        previous_weights_version: the version served before.
        num_tensors: tensors sent.
        num_bytes: tensor bytes sent.
        seconds: wall time of the call, client side (stream and swap).
        bytes_per_s: ``num_bytes / seconds``.
        server_stream_ms: the server's time from the first message to the commit.
        server_swap_ms: the server's time for the swap.
        replicas: a push to several replicas: each one's result, in order (empty else).
        delta: the push was a delta (``push_weights(delta=True)`` with a base the
            replicas held); ``num_bytes`` then counts the patches' indices too.
    """

    weights_version: str
    previous_weights_version: str
    num_tensors: int
    num_bytes: int
    seconds: float
    bytes_per_s: float
    server_stream_ms: float
    server_swap_ms: float
    replicas: list[PushResult] = dataclasses.field(default_factory=list)
    delta: bool = False

    @classmethod
    def from_proto(cls, msg: pb.UpdateWeightsResponse, seconds: float) -> PushResult:
        return cls(
            msg.weights_version,
            msg.previous_weights_version,
            msg.num_tensors,
            msg.num_bytes,
            seconds,
            msg.num_bytes / seconds if seconds > 0 else 0.0,
            msg.stream_ms,
            msg.swap_ms,
        )


def weights_version_argument(weights_version: str, version: str | None) -> str:
    """The version label of ``push_weights``: ``weights_version=``, the SDK's one name for
    it (as ``load_weights``); ``version=``, its old name, still works with a
    ``DeprecationWarning``.

    Raises:
        InvalidInputError: both given, different.
    """
    if version is None:
        return weights_version
    warnings.warn(
        "push_weights(version=...) is deprecated; pass weights_version=...",
        DeprecationWarning,
        stacklevel=3,
    )
    if weights_version and weights_version != version:
        raise InvalidInputError(
            f"weights_version={weights_version!r} and version={version!r} disagree; "
            "pass weights_version only"
        )
    return version


def push_requests(
    named_tensors: Iterable[tuple[str, object]],
    *,
    names: str,
    weights_version: str,
    partial: bool,
    chunk_bytes: int,
    progress: Progress | None,
    counters: dict,
    prepare_timeout_s: float | None = None,
    base: tuple[str, dict[str, RawTensor]] | None = None,
    kept: dict[str, RawTensor] | None = None,
    begin: dict | None = None,
    pack: bool = False,
) -> Iterator[pb.UpdateWeightsRequest]:
    """The messages of one push (``counters`` gets ``tensors`` and ``bytes`` sent); with
    ``prepare_timeout_s`` its commit only prepares (``megascore_client.push.replicas``).

    Deltas: with ``kept`` (a dict) the push asks the server to keep its tensors
    (``begin.keep``) and ``kept`` gets a copy of each; with ``base`` (the version the
    replica kept and its tensors) it is a delta: an unchanged tensor is not sent, one
    with few changed elements goes as one patch chunk
    (:func:`~megascore_client.push.packing.delta_chunk`). ``begin``:
    the begin's target fields (``weight_set``, ``adapter``, ``adapter_config``).

    ``pack`` (a server with ``ModelInfo.accepts_tensor_chunks``): consecutive tensors that
    fit in one chunk (and patches) go several to a message (``chunks``) up to
    ``chunk_bytes`` a message; a bigger tensor still goes as its own chunks.

    An exception while producing them (a tensor that cannot be pushed, the caller's
    iterable failing) ends the stream without a commit, so that the server drops what
    it staged, and is stored in ``counters["error"]`` for the caller to raise.
    """
    try:
        yield from _requests(
            named_tensors, names, chunk_bytes, progress, counters, base, kept, begin or {}, pack
        )
        commit = pb.UpdateWeightsCommit(weights_version=weights_version, partial=partial)
        if prepare_timeout_s is not None:
            commit.prepare, commit.prepare_timeout_s = True, prepare_timeout_s
        yield pb.UpdateWeightsRequest(commit=commit)
    except Exception as exc:  # noqa: BLE001 - raised by the caller after the call ends
        counters["error"] = exc


def _requests(named_tensors, names, chunk_bytes, progress, counters, base, kept, target, pack):
    """The messages of :func:`push_requests` before its commit: the begin, then each
    tensor's (:func:`~megascore_client.push.packing.tensor_messages`)."""
    if names not in _NAMES:
        raise InvalidInputError(f"names must be one of {sorted(_NAMES)}, got {names!r}")
    begin = pb.UpdateWeightsBegin(
        names=_NAMES[names],
        base_weights_version=base[0] if base else "",
        keep=kept is not None,
        **target,
    )
    yield pb.UpdateWeightsRequest(begin=begin)
    waiting = Pack(chunk_bytes, progress) if pack else None
    sent = 0
    for name, tensor in named_tensors:
        raw = to_raw(name, tensor)
        if kept is not None:  # a copy: the trainer changes its tensors in place
            raw = kept[name] = RawTensor(raw.dtype, raw.shape, memoryview(raw.data).tobytes())
        patch = delta_chunk(name, raw, base[1].get(name), chunk_bytes) if base else WHOLE
        if patch is None:
            continue
        sent = yield from tensor_messages(name, raw, patch, sent, chunk_bytes, waiting, progress)
        counters["tensors"] = counters.get("tensors", 0) + 1
        counters["bytes"] = sent
    if waiting is not None:
        yield from waiting.flush()


def chunk_size(chunk_bytes: int | None, message_limit: int) -> int:
    """Bytes of tensor data per message: ``chunk_bytes`` or the default, under the limit."""
    limit = max(1, message_limit - _CHUNK_HEADROOM)
    return max(1, min(chunk_bytes or DEFAULT_CHUNK_BYTES, limit))


def read_safetensors(path: str | Path) -> Iterator[tuple[str, RawTensor]]:
    """``(name, RawTensor)`` of every float tensor in a ``.safetensors`` file or a directory
    of them (sorted by file name), read straight from the file (no torch, bf16 kept)."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise InvalidInputError(f"{path}: no .safetensors file")
    for file in files:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
            base = 8 + size
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                dtype = _SAFETENSORS_DTYPES.get(meta["dtype"])
                if dtype is None:
                    raise InvalidInputError(f"{file}: tensor {name!r} has dtype {meta['dtype']}")
                start, stop = meta["data_offsets"]
                f.seek(base + start)
                yield name, RawTensor(dtype, tuple(meta["shape"]), f.read(stop - start))


def total_bytes(path: str | Path) -> int:
    """Tensor bytes of a safetensors file or directory (for a progress bar)."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    total = 0
    for file in files:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        total += sum(
            m["data_offsets"][1] - m["data_offsets"][0]
            for n, m in header.items()
            if n != "__metadata__"
        )
    return total


def finish(response_or_error, counters: dict, start: float) -> PushResult:
    """The call's result, or the error to raise: the requests' own error first."""
    if "error" in counters:
        raise counters["error"]
    if isinstance(response_or_error, Exception):
        raise response_or_error
    return PushResult.from_proto(response_or_error, time.perf_counter() - start)


class ProgressBar:
    """``progress`` callback drawing ``[####....]  45%  123.4/274.0 MB  56.7 MB/s`` on a
    terminal stream (one line, redrawn at most every ``interval`` seconds)."""

    def __init__(self, total: int, stream, interval: float = 0.2, width: int = 30):
        self.total, self.stream, self.interval, self.width = max(total, 1), stream, interval, width
        self.start = time.perf_counter()
        self._drawn = 0.0

    def __call__(self, sent: int, name: str) -> None:
        now = time.perf_counter()
        if now - self._drawn < self.interval and sent < self.total:
            return
        self._drawn = now
        frac = min(sent / self.total, 1.0)
        rate = sent / max(now - self.start, 1e-9)
        bar = "#" * int(frac * self.width)
        self.stream.write(
            f"\r[{bar:<{self.width}}] {frac:4.0%}  {sent / 1e6:.1f}/{self.total / 1e6:.1f} MB"
            f"  {rate / 1e6:.1f} MB/s  {name[-40:]:<40}"
        )
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


class ElapsedLine:
    """``progress(elapsed_s)`` callback of a load (``load_weights``) drawing
    ``loading hf:/ckpt ... 12 s`` on a terminal stream (one line, redrawn)."""

    def __init__(self, label: str, stream):
        self.label, self.stream = label, stream

    def __call__(self, elapsed_s: float) -> None:
        self.stream.write(f"\r{self.label} ... {elapsed_s:.0f} s")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def run_cli(args, client) -> int:
    """``megascore push-weights PATH``: pushes a safetensors file / directory's tensors."""
    import sys

    bar = None if args.no_progress else ProgressBar(total_bytes(args.path), sys.stderr)
    try:
        result = client.push_weights(
            read_safetensors(args.path),
            weights_version=args.weights_version,
            names=args.names,
            partial=args.partial,
            progress=bar,
            timeout=args.timeout,
        )
    finally:
        if bar is not None:
            bar.close()
    print(json.dumps(dataclasses.asdict(result)))
    return 0


def add_cli_arguments(parser) -> None:
    """Arguments of ``megascore push-weights``."""
    parser.add_argument("path", help="a .safetensors file or a directory of them (client side)")
    parser.add_argument(
        "--weights-version", default="", help="version label (default: generated by the server)"
    )
    parser.add_argument(
        "--names",
        choices=sorted(_NAMES),
        default="hf",
        help="naming of the tensors: hf (transformers) or megatron (default: hf)",
    )
    parser.add_argument(
        "--partial",
        action="store_true",
        help="update only the tensors sent (default: every tensor of the model must be sent)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

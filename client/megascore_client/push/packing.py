"""How one pushed tensor becomes ``UpdateWeightsRequest`` messages (:func:`tensor_messages`):
whole, as chunks under ``chunk_bytes``; as a delta's patch (:func:`delta_chunk`); or, for a
server that takes ``chunks`` (``ModelInfo.accepts_tensor_chunks``), packed with its
neighbours several to a message (:class:`Pack`). The stream around them (begin, commit)
is ``megascore_client.push.requests``."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator

import numpy as np

from megascore.v1 import scoring_pb2 as pb
from megascore_client.push.tensors import DTYPES, RawTensor

__all__ = ["WHOLE", "Pack", "Progress", "delta_chunk", "tensor_messages"]

Progress = Callable[[int, str], None]
"""``progress(bytes_sent_so_far, tensor_name)``, called after each chunk is handed to gRPC."""

_PIECE_FRAMING = 16  # a piece's tag and length prefixes inside a ``chunks`` message

WHOLE = object()
"""What :func:`delta_chunk` returns for a tensor sent whole."""


class Pack:
    """Small pieces waiting to go together in one ``chunks`` message (at most
    ``limit`` serialized bytes); each is reported to ``progress`` once sent. Pieces are
    written into the message itself as they come: building each apart, then the message
    of them, copied every byte twice more (the bench's adapter, 168 tensors of 8.9 MB:
    21 ms of the client's CPU to build and serialize its messages, 8 ms so)."""

    def __init__(self, limit: int, progress: Progress | None):
        self.limit, self.progress = limit, progress
        self.message = pb.UpdateWeightsRequest()
        self.sent: list[tuple[int, str]] = []  # each piece's bytes sent after it, its name
        self.size = 0

    def add(
        self, fill: Callable[[pb.TensorChunk], object], sent: int, name: str
    ) -> Iterator[pb.UpdateWeightsRequest]:
        """Adds the piece ``fill`` writes into an empty chunk, after the waiting pieces'
        message when it would pass the limit with them."""
        pieces = self.message.chunks.chunks
        fill(pieces.add())
        size = pieces[-1].ByteSize() + _PIECE_FRAMING
        if self.sent and self.size + size > self.limit:
            piece = pieces.pop()
            yield from self.flush()
            self.message.chunks.chunks.append(piece)
        self.sent.append((sent, name))
        self.size += size

    def flush(self) -> Iterator[pb.UpdateWeightsRequest]:
        """The waiting pieces' message (a lone one as a plain ``chunk``), if any."""
        if not self.sent:
            return
        message, sent = self.message, self.sent
        self.message, self.sent, self.size = pb.UpdateWeightsRequest(), [], 0
        if len(sent) == 1:
            message = pb.UpdateWeightsRequest(chunk=message.chunks.chunks[0])
        yield message
        if self.progress is not None:
            for done, name in sent:
                self.progress(done, name)


def _whole(name: str, shape, dtype: int, data: bytes) -> Callable[[pb.TensorChunk], None]:
    """Writes a whole tensor into a piece."""

    def fill(chunk: pb.TensorChunk) -> None:
        chunk.name = name
        chunk.shape.extend(shape)
        chunk.data.dtype = dtype
        chunk.data.data = data

    return fill


def _copy_of(patch: pb.TensorChunk) -> Callable[[pb.TensorChunk], None]:
    """Writes a delta's patch into a piece."""

    def fill(chunk: pb.TensorChunk) -> None:
        chunk.CopyFrom(patch)

    return fill


def tensor_messages(
    name: str,
    raw: RawTensor,
    patch,
    sent: int,
    chunk_bytes: int,
    waiting: Pack | None,
    progress: Progress | None,
) -> Generator[pb.UpdateWeightsRequest, None, int]:
    """The messages of tensor ``name`` (``patch``: its :func:`delta_chunk`, not None, or
    :data:`WHOLE`); returns the bytes sent so far (``sent`` before it). With ``waiting``
    (packing), a patch or a tensor of at most ``chunk_bytes`` joins the pack (flushed
    first when full); a bigger tensor flushes the pack, then goes as its own chunks."""
    view = memoryview(raw.data).cast("B")
    dtype = DTYPES[raw.dtype][0]
    if waiting is not None and (patch is not WHOLE or len(view) <= chunk_bytes):
        if patch is WHOLE:  # the whole tensor in one piece
            fill = _whole(name, raw.shape, dtype, view.tobytes())
            sent += len(view)
        else:
            fill = _copy_of(patch)
            sent += _patch_bytes(patch)
        yield from waiting.add(fill, sent, name)
        return sent
    if waiting is not None:  # the pieces before this tensor's own messages
        yield from waiting.flush()
    if patch is not WHOLE:
        yield pb.UpdateWeightsRequest(chunk=patch)
        sent += _patch_bytes(patch)
        if progress is not None:
            progress(sent, name)
        return sent
    offset = 0
    while True:
        piece = view[offset : offset + chunk_bytes]
        chunk = pb.TensorChunk(
            name=name,
            shape=raw.shape,
            data=pb.Array(dtype=dtype, data=piece.tobytes()),
            offset=offset,
        )
        yield pb.UpdateWeightsRequest(chunk=chunk)
        offset += len(piece)
        sent += len(piece)
        if progress is not None:
            progress(sent, name)
        if offset >= len(view):
            return sent


def _patch_bytes(patch: pb.TensorChunk) -> int:
    """Bytes a patch chunk sends: its new elements and their indices."""
    return len(patch.data.data) + len(patch.indices.data)


def delta_chunk(name: str, raw: RawTensor, kept: RawTensor | None, chunk_bytes: int):
    """What a delta sends of tensor ``name`` given the replica's ``kept`` copy: None
    when its bytes did not change, a patch chunk (``indices`` + the new elements, bit
    for bit) when that is under half the tensor's bytes and one chunk, else
    :data:`WHOLE`."""
    if kept is None or (kept.dtype, tuple(kept.shape)) != (raw.dtype, tuple(raw.shape)):
        return WHOLE
    dtype, size = DTYPES[raw.dtype]
    new = np.frombuffer(memoryview(raw.data).cast("B"), dtype=f"<u{size}")
    changed = np.flatnonzero(new != np.frombuffer(memoryview(kept.data).cast("B"), f"<u{size}"))
    if changed.size == 0:
        return None
    index_dtype = np.dtype("<i4") if new.size < 2**31 else np.dtype("<i8")
    patch_bytes = changed.size * (index_dtype.itemsize + size)
    if 2 * patch_bytes > new.nbytes or patch_bytes > chunk_bytes:
        return WHOLE
    indices = pb.Array(
        dtype=pb.DTYPE_INT32 if index_dtype.itemsize == 4 else pb.DTYPE_INT64,
        data=changed.astype(index_dtype).tobytes(),
    )
    return pb.TensorChunk(
        name=name,
        shape=raw.shape,
        data=pb.Array(dtype=dtype, data=new[changed].tobytes()),
        indices=indices,
    )

"""The tensors of one ``UpdateWeights`` stream, checked chunk by chunk and reassembled.

Torch-free. :class:`PushSession` checks every chunk against the targets the engine
listed at ``begin`` (name, full shape, float dtype, byte offsets, one expert layout),
applies a delta's patches to the kept copy, and reassembles each tensor in host memory
that :class:`TensorBuffers` reuses from tensor to tensor and push to push.
"""

from __future__ import annotations

import math
import re
import sys
import threading
import weakref

import numpy as np

from megascore.api.errors import InvalidRequestError, quoted
from megascore.api.types import (
    LAYOUT_COMMON,
    LAYOUT_PER_EXPERT,
    WEIGHT_NAMES_HF,
    WEIGHT_NAMES_PEFT,
    WeightTarget,
)
from megascore.api.wire import decode_array
from megascore.v1 import scoring_pb2 as pb

DTYPES = {  # proto Dtype -> (engine dtype name, element bytes)
    pb.DTYPE_FLOAT32: ("float32", 4),
    pb.DTYPE_BFLOAT16: ("bfloat16", 2),
    pb.DTYPE_FLOAT16: ("float16", 2),
    pb.DTYPE_FLOAT64: ("float64", 8),
}
STAGING_BYTES = 256 * 1024 * 1024
"""Tensor bytes received and waiting for the engine thread to stage them, at most (one
tensor of any size may always wait)."""
KEPT_AS_RECEIVED_BYTES = 256 << 10
"""A tensor of at most this many bytes that comes whole in one chunk (an adapter's
tensors, a norm: small tensors packed several to a message) is staged on the bytes it
came in, read-only, not copied into a pooled buffer (:class:`TensorBuffers`): at this
size the allocator reuses freed memory anyway, and the copy and the buffer's bookkeeping
cost 2-3 ms of an adapter push's ~30 ms of server CPU (``bench/adapters.py``). Bigger
tensors still get a pooled buffer (holding their bytes instead was measured slower:
new memory's page faults, docs/benchmarks.md)."""
_IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq")  # buffers of older transformers
_LAYOUT_NAMES = {1: "per-expert (block_sparse_moe.experts.E.*)", 2: "fused (mlp.experts.*)"}


class TensorBuffers:
    """Host memory that pushed tensors are assembled in, reused from tensor to tensor and
    from push to push (rank 0, the event loop).

    Each message's bytes are copied into a tensor's buffer as they arrive and freed at
    once, as a plain gRPC reader frees them: the allocator hands the next message the
    same memory, and the buffers themselves were written before, so the stream does
    not pay the page faults of new memory for every byte it receives (measured: that
    was most of what a push cost beyond the loopback). A buffer goes back to the free
    list when nothing uses its tensor any more (the engine may keep a view of one until
    its fused partners arrive: a buffer is handed out again only when no array or tensor
    uses it), at most ``limit`` bytes of them.

    "No array uses it" is CPython's reference count of the buffer: every numpy view of it
    holds a reference to it (``view.base``), and so does whatever holds such a view
    (``torch.frombuffer`` keeps its source). Views are dropped on the event loop and on
    the engine thread, so the free lists are guarded by a lock.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._free: dict[int, list[np.ndarray]] = {}
        self._held = 0  # bytes on the free lists
        self._lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        """A uint8 array of ``size`` bytes (uninitialised), a view of a pooled buffer."""
        base = None
        with self._lock:
            free = self._free.get(size, [])
            for i in range(len(free)):
                # the free list, ``free[i]`` and getrefcount's argument only: nothing else
                # uses it (every numpy view of it, and whatever holds one, counts here)
                if sys.getrefcount(free[i]) <= 2:
                    base = free.pop(i)
                    self._held -= size
                    break
        if base is None:
            base = np.empty(size, dtype=np.uint8)
        view = base[:]
        weakref.finalize(view, self._give, base)
        return view

    def _give(self, base: np.ndarray) -> None:
        """The tensor assembled in ``base`` is done with (its views may live on); runs in
        whichever thread dropped the last view."""
        with self._lock:
            if self._held + base.size <= self.limit:
                self._free.setdefault(base.size, []).append(base)
                self._held += base.size


class PushedTensor:
    """A tensor being reassembled from its chunks."""

    def __init__(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: int,
        layout: int,
        ignored: bool,
        buffers: TensorBuffers | None,
    ):
        self.name, self.shape, self.dtype, self.layout = name, shape, dtype, layout
        self.ignored = ignored  # received and checked, not staged
        self.total = math.prod(shape) * DTYPES[dtype][1]
        self._buffers = buffers
        self.data: np.ndarray | None = None  # the tensor's bytes, filled chunk by chunk
        self.received = 0

    def put(self, data: bytes) -> None:
        if self.data is None and len(data) == self.total <= KEPT_AS_RECEIVED_BYTES:
            self.data = np.frombuffer(data, np.uint8)  # whole and small: its bytes, no copy
            self.received = self.total
            return
        if self.data is None:
            take = self._buffers.take if self._buffers else lambda n: np.empty(n, np.uint8)
            self.data = take(self.total)
        self.data[self.received : self.received + len(data)] = np.frombuffer(data, np.uint8)
        self.received += len(data)

    @property
    def complete(self) -> bool:
        return self.received == self.total


class PushSession:
    """Checks and reassembles the chunks of one push (rank 0, no engine calls).

    Args:
        targets: every tensor name the push may carry (``Engine.begin_weight_update``).
        names: the name format, for messages.
        base: a delta push: the replica's kept tensors (name -> ``(dtype, shape,
            bytes)``) that its patches (chunks with ``indices``) apply to.
        keep: keep a copy of every complete tensor (:attr:`kept`) for later deltas.
        buffers: where tensors are assembled (None: new memory for each).
    """

    def __init__(
        self,
        targets: dict[str, WeightTarget],
        names: int,
        *,
        base: dict[str, tuple] | None = None,
        keep: bool = False,
        buffers: TensorBuffers | None = None,
    ):
        self.targets = targets
        self.names = {WEIGHT_NAMES_HF: "HF", WEIGHT_NAMES_PEFT: "peft"}.get(names, "Megatron")
        self.base = base  # a delta: the kept copies its patches apply to
        self.keep = keep
        self.buffers = buffers
        self.kept: dict[str, tuple] = {}  # with keep: name -> (dtype, shape, bytes)
        self.received: set[str] = set()
        self.layout = LAYOUT_COMMON  # the expert layout, once a tensor fixed it
        self.num_bytes = 0
        self._open: PushedTensor | None = None

    def add(self, chunk: pb.TensorChunk, index: int | str) -> PushedTensor | None:
        """Adds one chunk (message ``index`` of the stream, or a piece of a ``chunks``
        message, e.g. "3 (piece 2 of 9)"); returns the tensor it completes.

        Raises:
            InvalidRequestError: naming the tensor, for a name / shape / dtype the model
                does not have, a tensor sent twice, or chunks out of order.
        """
        name, shape = chunk.name, tuple(chunk.shape)
        where = f"message {index}, tensor {quoted(name)}"
        current = self._open
        if current is not None and (name != current.name or chunk.HasField("indices")):
            raise InvalidRequestError(
                f"{where}: tensor {current.name!r} got {current.received} of its "
                f"{current.total} bytes before the next tensor began"
            )
        if chunk.HasField("indices"):
            return self._patch(chunk, where)
        if current is None:
            current = self._start(name, shape, chunk.data.dtype, where)
        elif shape != current.shape or chunk.data.dtype != current.dtype:
            raise InvalidRequestError(f"{where}: shape or dtype changed between its chunks")
        data = chunk.data.data
        if chunk.offset != current.received:
            raise InvalidRequestError(
                f"{where}: chunk offset {chunk.offset}, expected {current.received}"
            )
        if current.received + len(data) > current.total:
            raise InvalidRequestError(
                f"{where}: more than the {current.total} bytes of shape {list(shape)} "
                f"in {pb.Dtype.Name(current.dtype)}"
            )
        current.put(data)
        self.num_bytes += len(data)
        if not current.complete:
            self._open = current
            return None
        self._open = None
        self._received(current)
        return current

    def _received(self, tensor: PushedTensor) -> None:
        self.received.add(tensor.name)
        if self.keep and not tensor.ignored:
            self.kept[tensor.name] = (tensor.dtype, tensor.shape, bytes(tensor.data))

    def _patch(self, chunk: pb.TensorChunk, where: str) -> PushedTensor:
        """A delta's patch: the kept copy of the tensor with the chunk's elements set."""
        if self.base is None:
            raise InvalidRequestError(f"{where}: indices (a patch) in a push that is not a delta")
        tensor = self._start(chunk.name, tuple(chunk.shape), chunk.data.dtype, where)
        kept = self.base.get(tensor.name)
        if kept is None or kept[:2] != (tensor.dtype, tensor.shape):
            has = "none" if kept is None else f"{pb.Dtype.Name(kept[0])} {list(kept[1])}"
            raise InvalidRequestError(
                f"{where}: a patch needs this replica's kept copy in the same dtype and "
                f"shape (kept: {has}); send the tensor whole"
            )
        if chunk.offset:
            raise InvalidRequestError(f"{where}: a patch is one chunk at offset 0")
        indices = decode_array(chunk.indices, f"{where} indices", (pb.DTYPE_INT32, pb.DTYPE_INT64))
        size = DTYPES[tensor.dtype][1]
        data = chunk.data.data
        if len(data) != indices.size * size:
            raise InvalidRequestError(
                f"{where}: {indices.size} indices need {indices.size * size} bytes of "
                f"values, got {len(data)}"
            )
        numel = math.prod(tensor.shape)
        if indices.size and not (0 <= int(indices.min()) and int(indices.max()) < numel):
            raise InvalidRequestError(f"{where}: an index outside [0, {numel})")
        patched = bytearray(kept[2])
        np.frombuffer(patched, dtype=f"<u{size}")[indices] = np.frombuffer(data, f"<u{size}")
        tensor.put(patched)
        self.num_bytes += len(data) + len(chunk.indices.data)
        self._received(tensor)
        return tensor

    def _start(self, name: str, shape: tuple[int, ...], dtype: int, where: str) -> PushedTensor:
        target = self.targets.get(name)
        if target is None and self.names == "HF" and _IGNORED_HF.fullmatch(name):
            target = WeightTarget(shape, ignored=True)
        if not name or target is None:
            raise InvalidRequestError(
                f"{where}: not a tensor of the served model ({self.names} names)"
            )
        if name in self.received:
            raise InvalidRequestError(f"{where}: sent twice in one push")
        if shape != target.shape:
            raise InvalidRequestError(
                f"{where}: shape {list(shape)}, the served model's is {list(target.shape)}"
            )
        if dtype not in DTYPES:
            got = pb.Dtype.Name(dtype) if dtype in pb.Dtype.values() else dtype
            allowed = ", ".join(pb.Dtype.Name(d) for d in DTYPES)
            raise InvalidRequestError(f"{where}: dtype {got} not accepted ({allowed})")
        if target.layout != LAYOUT_COMMON:
            if self.layout not in (LAYOUT_COMMON, target.layout):
                raise InvalidRequestError(
                    f"{where}: a {_LAYOUT_NAMES[target.layout]} expert tensor in a push that "
                    f"sent {_LAYOUT_NAMES[self.layout]} ones"
                )
            self.layout = target.layout
        return PushedTensor(name, shape, dtype, target.layout, target.ignored, self.buffers)

    def check_complete(self, partial: bool) -> None:
        """Raises InvalidRequestError when a tensor is half sent, or, unless ``partial``,
        when some tensor of the model was not sent (naming them)."""
        if self._open is not None:
            raise InvalidRequestError(
                f"commit: tensor {self._open.name!r} got {self._open.received} of its "
                f"{self._open.total} bytes"
            )
        if partial:
            return
        layout = LAYOUT_PER_EXPERT if self.layout == LAYOUT_COMMON else self.layout
        missing = sorted(
            name
            for name, target in self.targets.items()
            if not target.ignored
            and target.layout in (LAYOUT_COMMON, layout)
            and name not in self.received
        )
        if missing:
            raise InvalidRequestError(
                f"commit: {len(missing)} tensors of the model were not sent, e.g. "
                f"{missing[:4]}; to update only those sent, push with partial=True "
                "(SDK push_weights), --partial (megascore push-weights) or commit.partial "
                "(wire)"
            )

"""Weight pushes on the engine's side: rank 0's calls broadcast each WEIGHTS_* message
(:mod:`megascore.engine.ranks.protocol`) and every rank handles it (the workers from their loop,
:mod:`megascore.engine.worker_loop`): BEGIN lists the push's targets, each TENSOR's parts are
staged as shards (:mod:`megascore.engine.weights.push.apply`), COMMIT swaps them in once every rank
agrees, ABORT drops them.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import numpy as np
import torch

from megascore.api.errors import WorkerLostError
from megascore.api.types import WeightTarget
from megascore.engine.ranks import protocol
from megascore.engine.ranks.startup import DRIVER_RANK
from megascore.engine.weights.push.apply import (
    WeightStaging,
    gather_needs,
    gather_targets,
    weight_targets,
)

logger = logging.getLogger(__name__)
_readonly_warned = False  # torch warned (silenced) about a read-only buffer: it never repeats


@contextlib.contextmanager
def _one_thread():
    """Torch ops on this thread run single-threaded inside.

    For a pushed tensor's staging (slicing and copying shards: memory-bound). Run on the
    intra-op pool, each copy left the pool's threads spinning for more work after it,
    taking the cores the gRPC stream and the client need: measured on 2 cores, the
    server's CPU per push halved (fp32 0.72 -> 0.45 s, bf16 0.47 -> 0.23 s) and bf16
    push / loopback went from 0.73 to 0.87 (bench/weight_push.py).
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _frombuffer(data, dtype: torch.dtype) -> torch.Tensor:
    """``torch.frombuffer(data)``. A read-only buffer is only read (shards and an adapter's
    weights are copies): torch's warning about it is silenced, and torch gives that
    warning once per process, so only the first read-only buffer pays for the warnings
    context (about 8 us a tensor, each of an adapter's hundreds of small tensors once)."""
    global _readonly_warned
    if _readonly_warned or not memoryview(data).readonly:
        return torch.frombuffer(data, dtype=dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        tensor = torch.frombuffer(data, dtype=dtype)
    _readonly_warned = True
    return tensor


class WeightPushHandler:
    """The weight-push methods of :class:`~megascore.engine.runtime.DistributedEngine`
    (mixed into it: they use its groups, served model, open push and failure state)."""

    def begin_weight_update(self, names: int, weight_set: str = "") -> dict[str, WeightTarget]:
        """Opens a push into ``weight_set`` ("": the default) on every rank (dropping an
        unfinished one); returns its targets.

        Raises:
            NotFoundError: no weight set of that name (nothing sent).
        """
        self._require_driver("begin_weight_update")
        self._adapter_push = None
        index = self.sets.index(weight_set, "begin.weight_set")
        message = protocol.WeightsMessage(names=names, weight_set=index)
        self._send_weights(protocol.Command.WEIGHTS_BEGIN, message)
        return self._on_weights(protocol.Command.WEIGHTS_BEGIN, message)

    def stage_weight(
        self, name: str, dtype: str, shape: tuple[int, ...], data: np.ndarray, layout: int
    ) -> None:
        """One full tensor of the open push: its header to every rank, then each rank its
        parts of it (:meth:`WeightStaging.receive`); every rank stages its shards.

        ``data`` is the tensor's bytes, uint8 (a view of the server's pooled buffer,
        ``megascore_server.push.chunks.TensorBuffers``: the tensor built on it keeps it in
        use until every part is sent and staged; or, for a small tensor, the read-only
        bytes it came in)."""
        self._require_driver("stage_weight")
        torch_dtype = getattr(torch, dtype)
        if len(data):
            tensor = _frombuffer(data, torch_dtype).reshape(shape)
        else:
            tensor = torch.empty(shape, dtype=torch_dtype)
        if self._adapter_push is not None:  # an adapter's tensors wait on rank 0, uncopied
            self._adapter_push.tensors[name] = tensor  # (its weights are copies of them)
            return
        message = protocol.WeightsMessage(name=name, tensor=tensor, layout=layout)
        self._send_weights(protocol.Command.WEIGHTS_TENSOR, message)
        self._on_weights(protocol.Command.WEIGHTS_TENSOR, message)

    def commit_weights(self, weights_version: str, partial: bool) -> str:
        """Swaps the staged shards in on every rank, or raises CheckpointError (old kept);
        an adapter push (:meth:`begin_adapter_push`) holds its adapter on every rank."""
        self._require_driver("commit_weights")
        if self._adapter_push is not None:
            return self._commit_adapter(weights_version)
        message = protocol.WeightsMessage(version=weights_version, partial=partial)
        self._send_weights(protocol.Command.WEIGHTS_COMMIT, message)
        pushed = self._push_set
        self._on_weights(protocol.Command.WEIGHTS_COMMIT, message)
        return self.sets.records[pushed].weights_version

    def abort_weight_update(self) -> None:
        """Drops the open push's staged shards on every rank."""
        self._require_driver("abort_weight_update")
        self._adapter_push = None  # staged on rank 0 only
        self._send_weights(protocol.Command.WEIGHTS_ABORT, protocol.WeightsMessage())
        self._on_weights(protocol.Command.WEIGHTS_ABORT, protocol.WeightsMessage())

    def _send_weights(self, command, message) -> None:
        if self._broken is not None:
            raise WorkerLostError(f"replica is broken: {self._broken}")
        self._step += 1
        try:
            protocol.send_weights(command, message, self.command_group, DRIVER_RANK, device="cpu")
        except (RuntimeError, OSError) as e:
            raise self._mark_broken(f"broadcasting {command.name} failed: {e}") from e

    def _begin(self, message) -> dict[str, WeightTarget]:
        """Every rank: opens a push (staging) into its weight set and returns every rank's
        targets."""
        self._push_set = self.sets.names[message.weight_set]
        loaded, local = self.sets.records[self._push_set], None
        self._push_of = loaded
        try:
            self._push = WeightStaging(
                loaded.model,
                loaded.config,
                self.pg_collection,
                message.names,
                buffers=self._staging_buffers,
            )
            local = weight_targets(loaded.model, loaded.config, self.pg_collection, message.names)
        except Exception:  # noqa: BLE001 - every rank learns it through the gather
            logger.exception("rank %d: listing the push's tensors failed", self.rank)
            self._push = None
        try:
            targets = gather_targets(local, self.groups.status, loaded.config, message.names)
            gather_needs(self._push, self.groups.status)
        except RuntimeError as e:
            raise self._mark_broken(f"weight push begin all-gather failed: {e}") from e
        return targets

    def _on_weights(self, command, message) -> dict[str, WeightTarget] | None:
        """Every rank: one WEIGHTS_* message (BEGIN and COMMIT are collective); BEGIN
        returns every rank's targets."""
        if command == protocol.Command.WEIGHTS_BEGIN:
            return self._begin(message)
        elif command == protocol.Command.WEIGHTS_ABORT:
            if self._push is not None:
                self._staging_buffers = self._push.release()
            self._push = None
        elif self._push is None:
            raise self._mark_broken(f"{command.name} without an open weight push")
        elif command == protocol.Command.WEIGHTS_TENSOR:
            try:
                with _one_thread():  # memory-bound copies: see _one_thread
                    self._push.receive(
                        message.name,
                        message.tensor,
                        message.layout,
                        self.command_group,
                        DRIVER_RANK,
                    )
            except RuntimeError as e:
                raise self._mark_broken(f"sending the parts of {message.name!r} failed: {e}") from e
        else:
            push, self._push = self._push, None
            problem = push.problem(message.partial)
            record = self.sets.records[self._push_set]
            if self._push_of is not record:  # a LoadWeights reloaded the set meanwhile
                problem = "the served model was reloaded (LoadWeights) during the push: push again"
            self._staging_buffers = push.release()  # kept when the ranks do not agree
            self._agree_or_raise(problem, self.groups.status, "weight commit", "weight push")
            changed = len(push.staged)
            self._staging_buffers = {}  # apply frees the staged tensors it does not hand back
            self.sets.activate(self._push_set)
            self._staging_buffers = push.apply()
            record.weights_version = message.version
            self.sets.changed(self._push_set)
            if self._push_set == self.sets.default:
                self._forget_prefixes()
            logger.info(
                "rank %d: %d pushed parameters swapped in (%.1f MB of tensor parts sent, "
                "%.1f MB received); now serving %s",
                self.rank,
                changed,
                push.sent_bytes / 1e6,
                push.received_bytes / 1e6,
                message.version,
            )

"""The workers' side of a replica: ranks != 0 execute rank 0's commands until SHUTDOWN.

Each message comes from :func:`megascore.engine.ranks.protocol.recv_command`: a FORWARD runs the
step (:meth:`~megascore.engine.runtime.DistributedEngine._run_step`), RELOAD and the
WEIGHTS_* messages load or push weights (:mod:`megascore.engine.weights.reload`,
:mod:`megascore.engine.weights.push.handler`; a refused one keeps the old weights), ADAPTER
loads or pushes a LoRA adapter (:mod:`megascore.engine.weights.adapters`), SHUTDOWN tears
the rank down.
"""

from __future__ import annotations

import logging

from megascore.api.errors import CheckpointError
from megascore.api.losses import loss_names
from megascore.engine.ranks import protocol
from megascore.engine.ranks.startup import DRIVER_RANK

logger = logging.getLogger(__name__)


class WorkerLoop:
    """The worker loop of :class:`~megascore.engine.runtime.DistributedEngine` (mixed into
    it: it runs the engine's step, reload and weight-push handlers)."""

    def worker_loop(self) -> None:
        """Ranks != 0: executes rank 0's commands until SHUTDOWN.

        Raises:
            WorkerLostError: a step failed on some rank, rank 0 vanished or the
                protocol went out of step (the process should exit non-zero).
        """
        if self.rank == DRIVER_RANK:
            raise RuntimeError("worker_loop runs on ranks != 0")
        while True:
            try:
                command, batch, extra = protocol.recv_command(
                    self.command_group, DRIVER_RANK, loss_names(), device="cpu"
                )
            except (RuntimeError, OSError, protocol.ProtocolError) as e:
                raise self._mark_broken(f"rank {self.rank}: lost rank 0: {e}") from e
            if command == protocol.Command.SHUTDOWN:
                logger.info("rank %d: SHUTDOWN", self.rank)
                self._teardown()
                return
            if command in protocol.WEIGHT_COMMANDS:
                try:
                    self._on_weights(command, extra.weights)
                except CheckpointError as e:
                    logger.warning(
                        "rank %d: weight push refused, old weights kept: %s", self.rank, e
                    )
                continue
            if command == protocol.Command.ADAPTER:
                try:
                    self._on_adapter(extra.path)
                except CheckpointError as e:
                    logger.warning("rank %d: adapter refused, old one kept: %s", self.rank, e)
                continue
            if command == protocol.Command.RELOAD:
                try:
                    self._reload(extra.path, extra.version, self.sets.names[extra.weight_set])
                except CheckpointError as e:
                    logger.warning("rank %d: reload failed, old weights kept: %s", self.rank, e)
                continue
            self.sets.activate(self.sets.names[extra.weight_set])
            self._run_step(batch)

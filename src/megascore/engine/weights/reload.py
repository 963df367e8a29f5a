"""Loading new weights from a checkpoint into the served model (``LoadWeights``).

``EngineConfig.model`` and ``load_weights`` take the model strings of
:func:`megascore.checkpoint.parse_model_string` (built-in ``tiny``, ``builtin:tiny@7``
for weight seed 7, ``hf:DIR``, ``megatron:DIR``), loaded by
:func:`megascore.engine.weights.served_model.load_served_model` at start-up (a checkpoint's
model drawing no random weights) and
:func:`~megascore.engine.weights.served_model.reload_served_model`
on reload. ``load_weights`` first reads the new model's architecture from its config
alone on rank 0 and refuses another one (or a bad path) before any weight file is
opened; then it runs on every rank (RELOAD): each checks the checkpoint against its
model, the ranks agree, and only then does each overwrite its parameters in place (no
second model in memory). A failed check anywhere leaves the old weights serving; a
failure while writing (a file damaged past its headers or removed midway) breaks the
replica, which never serves a mix of two checkpoints.
"""

from __future__ import annotations

import logging

from megascore.api.errors import InvalidRequestError
from megascore.checkpoint import check_same_architecture, parse_model_string, read_model_config
from megascore.engine.ranks import protocol
from megascore.engine.ranks.startup import DRIVER_RANK, load_agreeing
from megascore.engine.schedule.step import agree_on_status
from megascore.engine.weights.served_model import reload_served_model

logger = logging.getLogger(__name__)


class WeightReload:
    """The reload methods of :class:`~megascore.engine.runtime.DistributedEngine` (mixed
    into it: they use its groups, served model and failure state)."""

    def load_weights(self, model: str, weights_version: str, weight_set: str = "") -> str:
        """Rank 0: loads new weights into a weight set on every rank; the old ones stay on
        failure.

        Args:
            model: ``builtin:NAME@SEED`` of the served built-in architecture, or
                ``hf:DIR`` / ``megatron:DIR`` of a checkpoint with the served architecture.
            weights_version: label of the new weights ("" derives one: the seed, or the
                checkpoint's label / file hash).
            weight_set: the set it replaces ("": the default).

        Returns:
            The set's new weights version.

        Raises:
            NotFoundError: no weight set of that name (no collective issued).
            InvalidRequestError: unsupported spec or another built-in (no collective issued).
            CheckpointError: a missing directory, unreadable config or another
                architecture, read from the config alone (no collective issued, nothing
                built); or some rank failed to load (old weights kept everywhere).
            WorkerLostError: the replica is broken or a collective failed.
        """
        self._require_driver("load_weights")
        index = self.sets.index(weight_set, "weight_set")
        try:
            spec = parse_model_string(model)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        served = self.loaded.spec
        if spec.kind == "builtin" and spec.name != served.name:
            raise InvalidRequestError(f"model {model!r}: the served model is {served.name!r}")
        # The architecture first, from the checkpoint's config (and, for its optional
        # parts, the weight files' headers): a mismatch (or a bad path) is refused before
        # any rank builds a model or reads a tensor.
        ignore_mtp = self.engine_cfg.ignore_mtp_layers
        check_same_architecture(
            read_model_config(model, ignore_mtp_layers=ignore_mtp), self.loaded.config, model
        )
        version = weights_version  # "" lets the loader derive one (seed, checkpoint hash)
        self._step += 1
        try:
            protocol.send_command(
                protocol.Command.RELOAD,
                self.command_group,
                DRIVER_RANK,
                device="cpu",
                path=model,
                version=version,
                step=self._step,
                weight_set=index,
            )
        except (RuntimeError, OSError) as e:
            raise self._mark_broken(f"broadcasting RELOAD failed: {e}") from e
        self._reload(model, version, self.sets.names[index])
        return self.sets.records[self.sets.names[index]].weights_version

    def load_other_sets(self) -> None:
        """Every rank, at start-up: loads every weight set after the default (``--weights``)
        into room of its own (:meth:`WeightSets.add`), then makes the default live again.

        Raises:
            CheckpointError: a set that does not load (another architecture, a bad path).
        """
        for name, model in self.engine_cfg.weight_set_models[1:]:
            self.sets.add(name)
            self._reload(model, "", name)
        self.sets.activate(self.sets.default)

    def _reload(self, model: str, version: str, weight_set: str) -> None:
        """Every rank: makes ``weight_set`` live, checks ``model`` against the served one,
        agrees, then loads it into the served parameters in place; the ranks agree again
        once written.

        A failure before the first agreement (any check) leaves the old weights serving
        (CheckpointError). A failure while writing leaves them partly overwritten: the
        replica is then broken (WorkerLostError), never serving a mix of two checkpoints.
        """
        self.sets.activate(weight_set)
        new, error = load_agreeing(
            # Checks the architecture from the config before anything else (every rank:
            # rank 0 checked it already, but a worker may see other files).
            lambda before_write: reload_served_model(
                self.sets.records.get(weight_set, self.loaded),
                model,
                self.engine_cfg,
                self.pg_collection,
                weights_version=version,
                before_write=before_write,
            ),
            lambda problem: self._agree_or_raise(
                problem, self.load_group, "reload", f"loading {model!r}"
            ),
            f"loading {model!r}",
        )
        try:
            failed = agree_on_status(error is not None, self.load_group)
        except RuntimeError as e:
            raise self._mark_broken(f"reload status all-reduce failed: {e}") from e
        if failed:
            raise self._mark_broken(
                f"loading {model!r} failed on ranks {failed} after the weights began to be "
                f"overwritten: {error if error is not None else 'see the log of those ranks'}"
            )
        self.sets.records[weight_set] = new
        self.sets.changed(weight_set)
        if weight_set == self.sets.default:
            self._forget_prefixes()
        logger.info("rank %d: set %s now serves %s", self.rank, weight_set, new.weights_version)

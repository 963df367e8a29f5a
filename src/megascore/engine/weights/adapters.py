"""LoRA adapters on a served replica (docs/engine.md "LoRA adapters"): loaded at start-up
(``--adapter NAME=DIR[@SET]``), by ``LoadWeights`` of an adapter, or pushed.

An adapter is a served name over one weight set (:class:`~megascore.api.served_models.
ServedModel` with ``base`` and ``slot``, listed by :meth:`WeightSets.served`). Every rank
holds it on its model's registry (:func:`megascore.model.lora.attach`), at the same slot:
every rank loads and pushes the same adapters in the same order, rank 0 first telling the
workers with one ADAPTER message (:mod:`megascore.engine.ranks.protocol`: the operation
as JSON, a push's tensors broadcast after it). Each rank checks the adapter and makes its
layers' weights of it (:func:`megascore.checkpoint.lora_weights.adapter_weights`), the
ranks agree, and only then does each hold it: a refused adapter changes nothing anywhere.

A push (``UpdateWeights`` naming an adapter) stages its tensors on rank 0 only (an
adapter is megabytes) and sends them to every rank at its commit. A step scores a
sequence with its adapter from the input ``adapter`` (the slot per sequence; rank 0 fills
it from the request's ``model``, :meth:`AdapterHandler._with_adapter`). The prefix
cache keys an adapter's sequences by the adapter and its version
(:meth:`~megascore.engine.weights.sets.WeightSets.cache_seeds`), so a changed adapter
needs no flush: its old blocks are never read again and age out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megascore.api.errors import (
    CheckpointError,
    InvalidRequestError,
    NotFoundError,
    WorkerLostError,
    quoted,
)
from megascore.api.served_models import ServedModel
from megascore.api.types import WeightTarget
from megascore.checkpoint.lora_weights import PUSHED, adapter_weights
from megascore.checkpoint.peft_adapter import (
    WEIGHTS_FILE,
    AdapterConfig,
    push_targets,
    read_adapter_dir,
)
from megascore.engine.ranks import protocol
from megascore.engine.ranks.startup import DRIVER_RANK
from megascore.model.lora import attach

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class AdapterPush:
    """An open adapter push on rank 0: its tensors, staged here until the commit."""

    name: str
    base: str
    config: dict | None  # adapter_config.json's object; None: the adapter's own
    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def dir_version(path: str) -> str:
    """A label of the adapter saved in ``path``: ``adapter-`` + 12 hex digits of its weights
    file's SHA-256 (read once; an adapter is megabytes)."""
    digest = hashlib.sha256((Path(path) / WEIGHTS_FILE).read_bytes()).hexdigest()
    return f"adapter-{digest[:12]}"


class AdapterHandler:
    """The adapter methods of :class:`~megascore.engine.runtime.DistributedEngine` (mixed
    into it: they use its weight sets, groups and failure state)."""

    _adapter_push: AdapterPush | None = None

    def load_start_adapters(self) -> None:
        """Every rank, at start-up after the weight sets: the ``--adapter`` adapters.

        Raises:
            CheckpointError: an adapter that does not load (on every rank).
        """
        for name, path, base in self.engine_cfg.adapter_dirs:
            self._on_adapter({"op": "load", "name": name, "path": path, "base": base})

    def load_adapter(self, name: str, path: str, weights_version: str = "", weight_set="") -> str:
        """Rank 0: loads (or replaces) adapter ``name`` from peft directory ``path`` on every
        rank; the old one (if any) stays on failure.

        Args:
            name: the adapter's served name (not a weight set's).
            path: ``adapter_config.json`` + ``adapter_model.safetensors``.
            weights_version: its label ("": :func:`dir_version`).
            weight_set: the set it is over ("": the adapter's own, or the default).

        Returns:
            The adapter's version.

        Raises:
            NotFoundError: no weight set ``weight_set``.
            InvalidRequestError: ``name`` is a weight set's.
            CheckpointError: some rank refused it (named; nothing changed).
        """
        self._require_driver("load_adapter")
        base = self._adapter_base(name, weight_set, "weight_set")
        spec = {"op": "load", "name": name, "path": path, "base": base, "version": weights_version}
        self._send_adapter(spec)
        self._on_adapter(spec)
        return self.sets.adapters[name].weights_version

    def begin_adapter_push(self, name: str, config: str, weight_set: str = "") -> dict:
        """Rank 0: opens a push of adapter ``name`` (its tensors staged here until the
        commit, :meth:`commit_weights`); returns the peft tensor names it may carry.

        Args:
            name: the adapter (new when ``config`` is given).
            config: ``adapter_config.json`` as JSON ("": the adapter's own config).
            weight_set: the set a new adapter is over ("": the default).

        Raises:
            NotFoundError: an unknown set, or an unknown adapter without a config.
            InvalidRequestError: ``name`` is a weight set's.
            CheckpointError: a config that refuses (nothing opened).
        """
        self._require_driver("begin_adapter_push")
        base = self._adapter_base(name, weight_set, "begin.weight_set")
        if not config and name not in self.sets.adapters:
            raise NotFoundError(f"begin.adapter: no adapter {quoted(name)} (push its config)")
        try:
            parsed = json.loads(config) if config else None
        except ValueError as e:
            raise InvalidRequestError(f"begin.adapter_config: not JSON ({e})") from e
        checked = self._adapter_config(name, parsed, "begin.adapter_config")
        self._adapter_push = AdapterPush(name, base, parsed)
        targets = push_targets(checked, self.loaded.config)
        return {key: WeightTarget(shape) for key, shape in targets.items()}

    def _adapter_base(self, name: str, weight_set: str, field: str) -> str:
        """The set adapter ``name`` is over: ``weight_set``, else its own, else the default."""
        if name in self.sets.names or not name:
            raise InvalidRequestError(f"adapter: {quoted(name)} must name an adapter, not a set")
        if not weight_set and name in self.sets.adapters:
            return self.sets.adapters[name].base
        return self.sets.names[self.sets.index(weight_set, field)]

    def _adapter_config(self, name: str, config: dict | None, source: str) -> AdapterConfig:
        if config is None:
            return attach(self.loaded.model).meta(name)
        return AdapterConfig.from_dict(config, source)

    def _commit_adapter(self, weights_version: str) -> str:
        """Rank 0: the open adapter push to every rank, held once every rank agrees."""
        push, self._adapter_push = self._adapter_push, None
        spec = {"op": "push", "name": push.name, "base": push.base, "version": weights_version}
        spec["config"] = push.config
        spec["tensors"] = [[n, str(t.dtype)[6:], list(t.shape)] for n, t in push.tensors.items()]
        self._send_adapter(spec)
        self._on_adapter(spec, push.tensors)
        return self.sets.adapters[push.name].weights_version

    def _send_adapter(self, spec: dict) -> None:
        if self._broken is not None:
            raise WorkerLostError(f"replica is broken: {self._broken}")
        self._step += 1
        try:
            protocol.send_command(
                protocol.Command.ADAPTER,
                self.command_group,
                DRIVER_RANK,
                device="cpu",
                path=json.dumps(spec),
                step=self._step,
            )
        except (RuntimeError, OSError) as e:
            raise self._mark_broken(f"broadcasting ADAPTER failed: {e}") from e

    def _receive_tensors(self, spec: dict, tensors: dict | None) -> dict[str, torch.Tensor]:
        """Every rank: a push's tensors, broadcast from rank 0 as raw bytes (rank 0 keeps
        its own; a one-rank replica broadcasts nothing)."""
        if dist.get_world_size(self.command_group) == 1:
            return tensors
        out = {}
        for name, dtype, shape in spec.get("tensors", ()):
            torch_dtype = getattr(torch, dtype)
            if tensors is not None:
                raw = tensors[name].contiguous().view(-1).view(torch.uint8)
            else:
                size = int(np.prod(shape)) * torch.empty((), dtype=torch_dtype).element_size()
                raw = torch.empty(size, dtype=torch.uint8)
            try:
                dist.broadcast(raw, src=DRIVER_RANK, group=self.command_group)
            except RuntimeError as e:
                raise self._mark_broken(f"broadcasting adapter tensor {name}: {e}") from e
            out[name] = raw.view(torch_dtype).reshape(shape)
        return out

    def _on_adapter(self, spec: dict | str, tensors: dict | None = None) -> None:
        """Every rank: one adapter load or push (``spec``; a worker gets it as JSON)."""
        spec = json.loads(spec) if isinstance(spec, str) else spec
        name, base = spec["name"], spec["base"]
        received = self._receive_tensors(spec, tensors) if spec["op"] == "push" else {}
        problem = weights = config = None
        try:
            if spec["op"] == "load":
                config, received, source = read_adapter_dir(spec["path"])
                version = spec.get("version") or dir_version(spec["path"])
            else:
                config = self._adapter_config(name, spec.get("config"), PUSHED)
                version, source = spec["version"], PUSHED
            weights = adapter_weights(
                self.loaded.model, self.loaded.config, received, config, source
            )
        except (CheckpointError, OSError, KeyError) as e:
            problem = getattr(e, "reason", None) or f"{type(e).__name__}: {e}"
        self._agree_or_raise(problem, self.load_group, "adapter", f"adapter {quoted(name)}")
        slot = attach(self.loaded.model).put(name, weights, meta=config)
        self.sets.adapters[name] = ServedModel(name, version, base, slot)
        self.sets.changed(name)
        logger.info(
            "rank %d: adapter %s (slot %d) over %s: %s", self.rank, name, slot, base, version
        )

    def _with_adapter(self, batch, weight_set: int, slot: int):
        """``batch`` with its sequences' adapter slots: all ``slot`` (an adapter's, else -1:
        as they came), each checked to be an adapter of weight set ``weight_set``.

        Raises:
            InvalidRequestError: a sequence's slot holds no adapter of that set (named).
        """
        if slot >= 0:
            rows = np.full(batch.num_sequences, slot, dtype=np.int64)
            batch = dataclasses.replace(batch, adapter=rows)
        if batch.adapter is None:
            return batch
        base = self.sets.names[weight_set]
        held = [e.slot for e in self.sets.adapters.values() if e.base == base]
        bad = np.flatnonzero(~np.isin(batch.adapter, [-1, *held]))
        if bad.size:
            raise InvalidRequestError(
                f"adapter: sequence {int(bad[0])} names slot {int(batch.adapter[bad[0]])}, "
                f"no adapter of weight set {quoted(base)}"
            )
        return batch

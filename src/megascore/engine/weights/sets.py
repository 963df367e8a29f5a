"""Named full weight sets of one architecture on one replica (docs/engine.md "Weight sets").

A replica may serve several full sets of weights of its one model (``--weights
NAME=MODEL``, the first the default): the model's parameters hold one set at a time,
the *live* one. A step names its set in its broadcast header
(:mod:`megascore.engine.ranks.protocol`) and every rank makes that set live before the
step runs (:meth:`WeightSets.activate`, at a step boundary: a step never mixes sets). The
sets that are not live wait by the replica's policy (``EngineConfig.weight_sets``):

* ``resident``: on the device; making a set live points every parameter's ``data`` at
  that set's tensors (no copy, exact).
* ``host``: in host memory (page-locked for CUDA parameters); making a set live swaps,
  parameter by parameter, the device values with the set's host copy (the leaving set's
  values go to the host buffers the arriving set leaves: one set on the device, the
  others on the host, one parameter's transient copy on the device).

Each set has its own :class:`~megascore.engine.weights.served_model.LoadedModel` record
(what it was loaded from, its weights version); a load or a push names the set it
changes, which is made live first (:mod:`megascore.engine.weights.reload`,
:mod:`megascore.engine.weights.push.handler`).
"""

from __future__ import annotations

import logging

import torch

from megascore.api.errors import NotFoundError, quoted
from megascore.api.served_models import ServedModel, resolve
from megascore.engine.weights.served_model import LoadedModel
from megascore.model.weights import unwrap_model

logger = logging.getLogger(__name__)


class WeightSets:
    """The weight sets of a replica on one rank: their records and the tensors of those
    that are not live.

    Args:
        loaded: the default set, built and loaded (its tensors are the parameters').
        names: every set's name, the default first.
        policy: "resident" or "host" (module docstring).
    """

    def __init__(self, loaded: LoadedModel, names: tuple[str, ...], policy: str):
        self.names = tuple(names)
        self.policy = policy
        self.records: dict[str, LoadedModel] = {self.names[0]: loaded}
        self.live = self.names[0]
        self.adapters: dict[str, ServedModel] = {}  # LoRA adapter name -> its entry (slot, base)
        self._changes: dict[str, int] = {}  # set or adapter name -> times its weights changed
        self._params = dict(unwrap_model(loaded.model).named_parameters())
        self._waiting: dict[str, dict[str, torch.Tensor]] = {}  # the sets not live

    @property
    def default(self) -> str:
        """The default set's name (a request that names none is scored with it)."""
        return self.names[0]

    def index(self, name: str, field: str = "options.model") -> int:
        """The header index of set ``name`` ("" or the model's own name: the default;
        :func:`megascore.api.served_models.resolve`).

        Raises:
            NotFoundError: no set of that name (an adapter's included), naming ``field``.
        """
        entry = self.resolve(name, field)
        if entry.base:
            raise NotFoundError(f"{field}: {quoted(name)} is a LoRA adapter, not a weight set")
        return self.names.index(entry.name)

    def resolve(self, name: str, field: str = "options.model") -> ServedModel:
        """The set or adapter a request's ``name`` selects (NotFoundError naming ``field``)."""
        own_name = self.records[self.default].spec.name
        return resolve(self.served(), own_name, name, field)

    def target(self, name: str, field: str = "options.model") -> tuple[int, int]:
        """``(set index, adapter slot or -1)`` a request's ``name`` is scored with."""
        entry = self.resolve(name, field)
        return self.names.index(entry.base or entry.name), entry.slot

    def served(self) -> tuple[ServedModel, ...]:
        """Every set as the name registry lists it, the default first, then the adapters."""
        sets = tuple(ServedModel(n, self.records[n].weights_version) for n in self.names)
        return sets + tuple(self.adapters.values())

    def cache_seeds(self, batch, name: str) -> list[bytes]:
        """Per sequence of ``batch`` scored under set ``name``, what its prefix-cache keys
        are seeded with (:func:`megascore.engine.cache.index.chain_keys`): the set and,
        for a sequence of a LoRA adapter (its ``adapter`` slot), the adapter, each with
        its version and the count of its changes (:meth:`changed`: a push may reuse a
        version's label), so no set's or adapter's cached blocks are ever another's, nor
        those of its weights before a change."""

        def key(name: str, version: str) -> str:
            return f"{name}\0{version}\0{self._changes.get(name, 0)}"

        head = key(name, self.records[name].weights_version)
        by_slot = {a.slot: key(a.name, a.weights_version) for a in self.adapters.values()}
        slots = [-1] * batch.num_sequences if batch.adapter is None else batch.adapter
        return [f"{head}\0{by_slot.get(int(s), '')}".encode() for s in slots]

    def changed(self, name: str) -> None:
        """Set or adapter ``name`` has new weights (a load or a push): its cached prefixes
        are never read again (:meth:`cache_seeds`)."""
        self._changes[name] = self._changes.get(name, 0) + 1

    def add(self, name: str) -> None:
        """Room for set ``name`` beside the live one (its values unset until a load
        writes them, with the set made live)."""
        self._waiting[name] = {n: self._room(p) for n, p in self._params.items()}

    def _room(self, param: torch.Tensor) -> torch.Tensor:
        if self.policy == "resident":
            return torch.empty_like(param.data)
        pinned = param.device.type == "cuda"
        return torch.empty(param.shape, dtype=param.dtype, pin_memory=pinned)

    def activate(self, name: str) -> None:
        """Makes set ``name`` live on this rank (every rank, between two steps)."""
        if name == self.live:
            return
        arriving = self._waiting.pop(name)
        with torch.no_grad():
            leaving = {n: self._swap(p, arriving[n]) for n, p in self._params.items()}
        self._waiting[self.live] = leaving
        logger.debug("weight set %s live (was %s)", name, self.live)
        self.live = name

    def _swap(self, param: torch.Tensor, waiting: torch.Tensor) -> torch.Tensor:
        """Puts ``waiting`` into ``param``; returns the tensor that now holds the values
        ``param`` had."""
        if self.policy == "resident":
            held, param.data = param.data, waiting
            return held
        held = param.data.clone()
        param.data.copy_(waiting)
        waiting.copy_(held)
        return waiting

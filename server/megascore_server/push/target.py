"""What an ``UpdateWeights`` stream changes, from its ``begin``: a weight set's tensors, or
the whole of one LoRA adapter (docs/engine.md "LoRA adapters"). Torch-free."""

from __future__ import annotations

import dataclasses

from megascore.api.errors import InvalidRequestError
from megascore.api.types import WEIGHT_NAMES_HF, WEIGHT_NAMES_MEGATRON, WEIGHT_NAMES_PEFT
from megascore.v1 import scoring_pb2 as pb
from megascore_server.validation import MAX_ID_CHARS, check_length

_NAMES = {
    pb.WEIGHT_NAMES_HF: WEIGHT_NAMES_HF,
    pb.WEIGHT_NAMES_MEGATRON: WEIGHT_NAMES_MEGATRON,
    pb.WEIGHT_NAMES_PEFT: WEIGHT_NAMES_PEFT,
}


@dataclasses.dataclass(frozen=True)
class PushTarget:
    """The set or adapter a push changes.

    Attributes:
        names: ``WEIGHT_NAMES_*`` of its tensors.
        weight_set: the set it changes, or a new adapter's set ("": the default).
        adapter: the adapter it replaces whole ("": a weight set's push).
        adapter_config: the adapter's ``adapter_config.json`` text ("": its own).
    """

    names: int
    weight_set: str = ""
    adapter: str = ""
    adapter_config: str = ""

    @classmethod
    def from_begin(cls, begin: pb.UpdateWeightsBegin) -> PushTarget:
        """The target of a stream's ``begin``.

        Raises:
            InvalidRequestError: names that do not fit it, or a delta of an adapter.
        """
        names = _NAMES.get(begin.names)
        adapter = begin.adapter
        check_length("begin.adapter", adapter, MAX_ID_CHARS)
        check_length("begin.weight_set", begin.weight_set, MAX_ID_CHARS)
        if adapter and names != WEIGHT_NAMES_PEFT:
            raise InvalidRequestError("begin.names: an adapter's push is WEIGHT_NAMES_PEFT")
        if names is None or (names == WEIGHT_NAMES_PEFT and not adapter):
            raise InvalidRequestError(
                "begin.names: WEIGHT_NAMES_HF or WEIGHT_NAMES_MEGATRON (WEIGHT_NAMES_PEFT with "
                "begin.adapter)"
            )
        if adapter and (begin.base_weights_version or begin.keep):
            raise InvalidRequestError(
                "begin.base_weights_version / begin.keep: an adapter is pushed whole"
            )
        return cls(names, begin.weight_set, adapter, begin.adapter_config)

    @property
    def served(self) -> str:
        """The served name whose version the push changes ("": the default set)."""
        return self.adapter or self.weight_set

    def open(self, engine) -> dict:
        """Opens the push on ``engine`` (its thread); returns the names it may carry."""
        if self.adapter:
            return engine.begin_adapter_push(self.adapter, self.adapter_config, self.weight_set)
        return engine.begin_weight_update(self.names, self.weight_set)

"""The names a request's ``model`` may take: the one lookup of the served weight sets
and the LoRA adapters over them for every front, ``/v1/models`` and the engine.

A replica serves one or more full weight sets of one architecture (docs/engine.md
"Weight sets"): the first is the default, which a request that names no model gets, and
so does one naming the served model itself (``ModelInfo.name``: what OpenAI clients
send). An adapter is one more :class:`ServedModel` whose ``base`` is the set it is
applied over (docs/engine.md "LoRA adapters"); the lookup is :func:`resolve`.
"""

from __future__ import annotations

import dataclasses

from megascore.api.errors import NotFoundError, quoted


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """One name a request's ``model`` may take.

    Attributes:
        name: the name (a weight set's or an adapter's).
        weights_version: the version of its weights (each set and adapter has its own).
        base: the weight set it runs on ("" for a weight set itself; an adapter's set).
        slot: an adapter's slot, the value of its sequences in a step's input ``adapter``
            (-1: a weight set); the engine's, not on the wire.
    """

    name: str
    weights_version: str
    base: str = ""
    slot: int = -1


def resolve(served: tuple[ServedModel, ...], own_name: str, name: str, field: str) -> ServedModel:
    """The entry of ``served`` a request's ``name`` selects.

    Args:
        served: the registry, the default first.
        own_name: the served model's name (``ModelInfo.name``): selects the default.
        name: what the request names ("" for the default).
        field: the request field, for the message.

    Raises:
        NotFoundError: no entry of that name, naming it and ``field``.
    """
    if name in ("", own_name):
        return served[0]
    for entry in served:
        if entry.name == name:
            return entry
    known = ", ".join(entry.name for entry in served)
    raise NotFoundError(f"{field}: the model {quoted(name)} does not exist (served: {known})")

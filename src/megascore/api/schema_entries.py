"""The kinds of entries of the one table (:mod:`megascore.api.schema`): a scalar option,
an input array, an output. Every layer reads the table through them; ``schema`` re-exports
them (``schema.Output(...)``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

TOKEN = "token"
"""An output or input with one row per token (``[T, *dims]``)."""
SEQUENCE = "sequence"
"""An output or input with one row per sequence (``[B, *dims]``; inputs ``[B]``). A
per-sequence output with a ``head`` is the output head's row at the *last* position of
each sequence: the prediction after its last token (:func:`at_last_row`)."""


@dataclasses.dataclass(frozen=True)
class Option:
    """A scalar request option.

    Attributes:
        name: the ``ScoreOptions`` field and the ``ScoreBatch`` attribute.
        default: its value when unset.
        merge: the value of a step from its requests' values.
        check: ``(value, limits) -> error message or None`` (limits:
            :class:`~megascore.api.limits.Limits`); the message is prefixed with
            ``options.<name>: ``.
        convert: wire value -> domain value (after the check).
        flag: a boolean sent as a header flag bit by the broadcast protocol; else an
            integer header slot (``protocol``) or, for ``losses``, the loss bitmask.
        broadcast: sent to the other ranks at all; False: rank 0's business only
            (``weights_version``, checked against the served version before the step).
        names: an enum option: the SDK takes these names (the first is its default)
            and sends their wire values.
    """

    name: str
    default: Any
    merge: Callable[[list], Any]
    check: Callable[[Any, Any], str | None] | None = None
    convert: Callable[[Any], Any] = lambda value: value
    flag: bool = True
    broadcast: bool = True
    names: dict[str, int] | None = None


@dataclasses.dataclass(frozen=True)
class Input:
    """An array a request may carry besides ``token_ids`` and ``lengths``.

    Attributes:
        name: the ``ScoreRequest`` field and the ``ScoreBatch`` attribute.
        per: :data:`TOKEN` or :data:`SEQUENCE`.
        dtype: numpy dtype in the batch and on the broadcast.
        ndim: trailing dimensions after the token / sequence axis (their sizes travel
            in the broadcast header).
        fill: what a merged step holds for a request that did not send it; None: a
            step holds it for all its requests or for none.
        check: ``values -> what is wrong or None``: the one check of the values (a
            scalar per request or an array; :func:`check_input`), where the shape is not
            all there is to check.
        head: a per-token input the output head reads (:func:`head_inputs`): the engine
            carries it, by name, to the row that predicts each token
            (``ChunkScores.inputs``), and tokens share a row only where they agree on it.
            Its trailing size is ``num_<name>`` to an output's ``dims``.
        reference: the step under the request's reference set carries it too (its
            logprobs are then those of the same tokens, temperatures, positions, routes).
        wire: a request may send it; False: the engine sets it (never decoded from a
            request by any front).
    """

    name: str
    per: str
    dtype: str
    ndim: int = 0
    fill: float | None = None
    check: Callable[[Any], str | None] | None = None
    head: bool = False
    reference: bool = False
    wire: bool = True


@dataclasses.dataclass(frozen=True)
class Output:
    """A result returned to the caller.

    Attributes:
        name: the :class:`~megascore.api.types.ScoreOutput` key (``output.<name>``).
        per: :data:`TOKEN` (``[T, *dims]``) or :data:`SEQUENCE` (``[B, *dims]``).
        dtype: numpy dtype in the output and on the wire.
        wire: the ``ScoreResponse`` field (an ``Array``, or for ``keys`` a
            ``map<string, Array>``).
        sdk: the ``ScoreResult`` attribute (per-token: a list of one array per
            sequence; per-sequence: one ``[B, *dims]`` array, or a dict of ``[B]`` ones
            for ``keys``).
        wanted: ``options -> bool`` (a ``ScoreBatch`` or a ``pb.ScoreOptions``: the
            option names are the same).
        dims: ``options -> trailing shape`` of a per-token or per-sequence output; a
            request's columns are the first ``dims`` of a merged step's. None: set by
            the model (routing).
        wire_dims: ``ScoreResponse`` integer fields carrying the trailing shape.
        fill: the value of entry 0 of each sequence (a predicted output has no
            prediction there).
        keys: ``options -> names`` of a map output (one ``[B]`` array per name).
        optional: the client accepts a response without it (None in the result).
        finish: computed on the output rank from the batch and the step's other outputs
            (``(batch, values) -> array``, or a dict for ``keys``), after the head
            outputs, in the table's order.
        needs: the outputs a ``finish`` reads (computed by the head when it is wanted,
            even when they are not returned; e.g. the logprobs of the losses).
        head: computed on the last pipeline stage from each chunk of the output
            head's logits (``megascore.engine.outputs.logprobs.ChunkScores``):
            ``chunk -> [C, *dims]`` tensor; it is then CP-gathered, sent to the output
            rank and mapped from packed to flat like the logprobs. A per-sequence
            output's head reads only the rows at the last position of each sequence
            (:func:`at_last_row`), with a top-k of ``max(1, top_k)``.
    """

    name: str
    per: str
    dtype: str
    wire: str
    sdk: str
    wanted: Callable[[Any], bool]
    dims: Callable[[Any], tuple[int, ...]] | None = lambda options: ()
    wire_dims: tuple[str, ...] = ()
    fill: float = 0.0
    keys: Callable[[Any], tuple[str, ...]] | None = None
    optional: bool = False
    head: Callable[[Any], Any] | None = None
    finish: Callable[[Any, dict], Any] | None = None
    needs: tuple[str, ...] = ()

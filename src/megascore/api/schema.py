"""The one table of what a score request asks for, carries and gets back (numpy, torch-free).

Every layer reads these declarations instead of naming fields one by one:

* :data:`OPTIONS`: scalar request options. The name is the ``ScoreOptions`` proto field
  *and* the :class:`~megascore.api.types.ScoreBatch` attribute; each declares its default,
  how a step of several requests combines it, and its one check (both in
  :mod:`megascore.api.option_rules`; the check is run by the wire gate,
  ``megascore_server.validation``, and by the engine, ``ScoreBatch.check``).
* :data:`INPUTS`: arrays a request may carry besides ids and lengths (per token or per
  sequence): dtype, the value a merged step gives requests that did not send one, how
  the broadcast protocol sends it (``megascore.engine.ranks.protocol``).
* :data:`OUTPUTS`: per-token and per-sequence results: dtype, trailing shape,
  the value of entry 0 of a sequence (no prediction there), the ``ScoreResponse``
  field, the SDK attribute, when a request wants it, and how the engine computes it.
  The step's PP broadcast and packed -> flat mapping (``megascore.engine.schedule.step``),
  selection / concatenation (:mod:`megascore.api.layout`), the response
  (``megascore_server.convert``) and the client's decode / merge
  (``megascore_client.splitting``) loop over it.

``docs/architecture.md`` ("Adding an output field or an option") has the recipe.
Consumers read ``schema.OUTPUTS`` at call time, so a test may extend the table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from megascore.api import layout, losses, mismatch
from megascore.api import option_rules as rules
from megascore.api.option_rules import (  # noqa: F401 - the table's names too
    LOGPROB_POSITIONS,
    MASKED,
    MAX_ID_CHARS,
)

TOKEN = "token"
"""An output or input with one row per token (``[T, *dims]``)."""
SEQUENCE = "sequence"
"""An output or input with one row per sequence (``[B, *dims]``; inputs ``[B]``). A
per-sequence output with a ``head`` is the output head's row at the *last* position of
each sequence: the prediction after its last token (:func:`at_last_row`)."""


# ---- options --------------------------------------------------------------------------------


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


OPTIONS: tuple[Option, ...] = (
    Option("return_logprobs", True, any, convert=bool),
    Option("top_k", 0, max, rules.check_top_k, int, flag=False),
    Option(
        "losses",
        (),
        rules.union,
        rules.check_losses,
        lambda names: rules.union([names]),
        flag=False,
    ),
    Option("return_moe_metrics", False, rules.one, rules.check_metric_group("moe", "MoE"), bool),
    Option("return_mtp_metrics", False, rules.one, rules.check_metric_group("mtp", "MTP"), bool),
    Option("return_routing", False, any, rules.check_routing, bool),
    Option("return_entropy", False, any, convert=bool),
    Option("return_importance_weights", False, any, convert=bool),
    Option("return_token_ranks", False, any, convert=bool),
    Option("return_next_token", False, any, convert=bool),
    Option(
        "weights_version", "", rules.pinned, rules.check_version, str, flag=False, broadcast=False
    ),
    Option(
        "logprob_positions",
        0,
        rules.masked,
        rules.check_positions,
        int,
        flag=False,
        names=LOGPROB_POSITIONS,
    ),
)


def option(name: str) -> Option:
    """The declaration of option ``name``."""
    return next(o for o in OPTIONS if o.name == name)


# ---- inputs ---------------------------------------------------------------------------------


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
    """

    name: str
    per: str
    dtype: str
    ndim: int = 0
    fill: float | None = None
    check: Callable[[Any], str | None] | None = None
    head: bool = False


FLOAT32_TINY = float(np.finfo(np.float32).tiny)
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _between(low: float, high: float, rule: str) -> Callable[[Any], str | None]:
    """A check that every value is finite and in ``[low, high]`` (else ``rule``)."""

    def check(values) -> str | None:
        try:
            v = np.asarray(values, dtype=np.float64)
        except (TypeError, ValueError):
            return rule
        return None if (np.isfinite(v) & (v >= low) & (v <= high)).all() else rule

    return check


def _whole_numbers(values) -> str | None:
    """A check that every value is an integer >= 0."""
    v = np.asarray(values)
    whole = np.issubdtype(v.dtype, np.integer) or (
        np.issubdtype(v.dtype, np.floating) and bool((np.floor(v) == v).all())
    )
    return None if whole and bool((v >= 0).all()) else "must be an integer >= 0"


def check_input(name: str, values) -> str | None:
    """The one check of input ``name``'s values (a scalar or an array; what the client,
    the wire gate and ``ScoreBatch.check`` all run): what is wrong, or None."""
    spec = next(s for s in INPUTS if s.name == name)
    return None if spec.check is None else spec.check(values)


INPUTS: tuple[Input, ...] = (
    Input("loss_mask", TOKEN, "uint8", fill=1),
    Input(
        "temperature",
        SEQUENCE,
        "float32",
        fill=1.0,
        check=_between(FLOAT32_TINY, FLOAT32_MAX, "must be finite and > 0 (a float32)"),
    ),
    Input("routing", TOKEN, "int32", ndim=2),
    Input("target_ids", TOKEN, "int64", ndim=1, fill=0, head=True),
    # 0.0, not NaN: a merged step is checked whole, and NaN is refused (a request that
    # sent no rollout logprobs gets no mismatch statistics back either way)
    Input("rollout_logprobs", TOKEN, "float64", fill=0.0),
    Input(
        "mismatch_ratio_cap",
        SEQUENCE,
        "float32",
        fill=mismatch.DEFAULT_RATIO_CAP,
        check=_between(np.nextafter(1.0, 2.0), FLOAT32_MAX, "must be finite and > 1"),
    ),
    # outputs from this entry on: the per-token outputs before it hold their fill, the
    # losses count from it (ScoreBatch.scored_mask); the engine computes no head row
    # before it and may take the rows before it from the prefix cache
    Input("score_from", SEQUENCE, "int64", fill=0, check=_whole_numbers),
)


# ---- outputs --------------------------------------------------------------------------------


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


def _routes(batch, values: dict) -> np.ndarray:
    """The routing of each token: the replayed routes of the request, else those the
    step recorded (``values["routing"]``, already in the flat layout)."""
    if batch.routing is not None:
        return np.asarray(batch.routing, dtype=np.int32)
    return values["routing"]


def _next_top_k(options) -> tuple[int]:
    """The columns of the next-token outputs: ``max(1, top_k)`` (the greedy token at least)."""
    return (max(1, options.top_k),)


OUTPUTS: tuple[Output, ...] = (
    Output(
        "logprobs",
        TOKEN,
        "float32",
        "token_logprobs",
        "logprobs",
        wanted=lambda o: o.return_logprobs,
        head=lambda chunk: chunk.target_logprobs(),
    ),
    Output(
        "top_k_ids",
        TOKEN,
        "int64",
        "top_k_ids",
        "top_k_ids",
        wanted=lambda o: o.top_k > 0,
        dims=lambda o: (o.top_k,),
        wire_dims=("top_k",),
        fill=-1,
        head=lambda chunk: chunk.top_k()[0],
    ),
    Output(
        "top_k_logprobs",
        TOKEN,
        "float32",
        "top_k_logprobs",
        "top_k_logprobs",
        wanted=lambda o: o.top_k > 0,
        dims=lambda o: (o.top_k,),
        wire_dims=("top_k",),
        head=lambda chunk: chunk.top_k()[1],
    ),
    Output(
        "routing",
        TOKEN,
        "int32",
        "routing",
        "routing",
        wanted=lambda o: o.return_routing,
        dims=None,
        wire_dims=("routing_num_moe_layers", "routing_topk"),
        finish=lambda batch, values: _routes(batch, values),
    ),
    Output(
        "losses",
        SEQUENCE,
        "float64",
        "sequence_losses",
        "loss",
        wanted=lambda o: bool(o.losses),
        keys=lambda o: tuple(o.losses),
        finish=lambda batch, values: losses.compute_losses(
            batch.losses, values["logprobs"], batch.lengths, batch.scored_mask()
        ),
        needs=("logprobs",),
    ),
    Output(
        "num_loss_tokens",
        SEQUENCE,
        "int64",
        "num_loss_tokens",
        "num_tokens",
        wanted=lambda o: True,
        optional=True,
        finish=lambda batch, values: layout.count_loss_tokens(batch.lengths, batch.scored_mask()),
    ),
    Output(
        "cached_tokens",
        SEQUENCE,
        "int64",
        "cached_tokens",
        "cached_tokens",
        wanted=lambda o: True,
        optional=True,
        finish=lambda batch, values: batch.cached_tokens(),
    ),
    Output(
        "entropy",
        TOKEN,
        "float32",
        "entropy",
        "entropy",
        wanted=lambda o: o.return_entropy,
        head=lambda chunk: chunk.entropy(),
    ),
    Output(
        "target_logprobs",
        TOKEN,
        "float32",
        "target_logprobs",
        "target_logprobs",
        wanted=lambda o: o.target_ids is not None,
        dims=lambda o: (o.num_target_ids,),
        wire_dims=("num_target_ids",),
        head=lambda chunk: chunk.id_logprobs(chunk.inputs["target_ids"]),
    ),
    Output(
        "mismatch",
        SEQUENCE,
        "float64",
        "mismatch",
        "mismatch_stats",
        wanted=lambda o: o.rollout_logprobs is not None,
        keys=lambda o: mismatch.NAMES,
        finish=lambda batch, values: mismatch.statistics(
            values["logprobs"],
            batch.rollout_logprobs,
            batch.lengths,
            batch.scored_mask(),
            batch.mismatch_ratio_cap,
        ),
        needs=("logprobs",),
    ),
    Output(
        "importance_weights",
        TOKEN,
        "float32",
        "importance_weights",
        "importance_weights",
        wanted=lambda o: o.return_importance_weights and o.rollout_logprobs is not None,
        finish=lambda batch, values: mismatch.importance_weights(
            values["logprobs"], batch.rollout_logprobs, batch.lengths, batch.mismatch_ratio_cap
        ),
        needs=("logprobs",),
    ),
    Output(
        "token_ranks",
        TOKEN,
        "int64",
        "token_ranks",
        "token_ranks",
        wanted=lambda o: o.return_token_ranks,
        head=lambda chunk: chunk.token_ranks(),
    ),
    Output(
        "next_token_ids",
        SEQUENCE,
        "int64",
        "next_token_ids",
        "next_token_ids",
        wanted=lambda o: o.return_next_token,
        dims=_next_top_k,
        wire_dims=("next_top_k",),
        head=lambda chunk: chunk.top_k()[0],
    ),
    Output(
        "next_token_logprobs",
        SEQUENCE,
        "float32",
        "next_token_logprobs",
        "next_token_logprobs",
        wanted=lambda o: o.return_next_token,
        dims=_next_top_k,
        wire_dims=("next_top_k",),
        head=lambda chunk: chunk.top_k()[1],
    ),
)


def head_inputs(batch) -> dict[str, Any]:
    """The per-token inputs of ``batch`` the output head reads (:attr:`Input.head`), by
    name; those it does not carry are left out."""
    return {
        spec.name: getattr(batch, spec.name)
        for spec in INPUTS
        if spec.head and getattr(batch, spec.name, None) is not None
    }


def input_columns(inputs: dict[str, Any]) -> dict[str, int]:
    """``num_<name>``: the trailing size of each head input (what ``Output.dims`` reads)."""
    return {f"num_{name}": int(values.shape[1]) for name, values in inputs.items()}


def output(name: str) -> Output:
    """The declaration of output ``name``."""
    return next(o for o in OUTPUTS if o.name == name)


def outputs(per: str | None = None) -> tuple[Output, ...]:
    """The output table (read at call time), optionally only ``per`` token / sequence."""
    return tuple(o for o in OUTPUTS if per is None or o.per == per)


def head_outputs(options) -> list[Output]:
    """The outputs the output head computes for a step with ``options``.

    A head output is also computed when a wanted ``finish`` output needs it (the
    logprobs of the losses), even when not returned.
    """
    needed = {name for o in OUTPUTS if o.wanted(options) for name in o.needs}
    return [o for o in OUTPUTS if o.head is not None and (o.wanted(options) or o.name in needed)]


def positional(output: Output) -> bool:
    """Whether ``logprob_positions`` restricts ``output``: a per-token output of the
    output head, or computed from them (``needs``); not the routing."""
    return output.per == TOKEN and (output.head is not None or bool(output.needs))


def at_last_row(output: Output) -> bool:
    """Whether ``output`` is the output head's row at the last position of each sequence
    (a per-sequence output with a ``head``): the prediction after the last token, which
    the per-token layout has no entry for. The engine computes it in a pass of its own
    over those rows, with a top-k of ``max(1, top_k)``, whatever rows the per-token
    outputs are computed at (``logprob_positions``)."""
    return output.per == SEQUENCE and output.head is not None


def flat_dims(output: Output, options) -> tuple[int, ...]:
    """Trailing shape of an output for ``options`` (``()`` when set by the data)."""
    return () if output.dims is None else tuple(output.dims(options))

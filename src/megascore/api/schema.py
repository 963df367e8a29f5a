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

from collections.abc import Callable
from typing import Any

import numpy as np

from megascore.api import layout, losses, mismatch, reference_kl
from megascore.api import option_rules as rules
from megascore.api.option_rules import (  # noqa: F401 - the table's names too
    LOGPROB_POSITIONS,
    MASKED,
    MAX_ID_CHARS,
)
from megascore.api.schema_entries import (  # noqa: F401 - the table's kinds of entries
    SEQUENCE,
    TOKEN,
    Input,
    Option,
    Output,
)

# ---- options --------------------------------------------------------------------------------


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
    # the weight set or adapter the request is scored with, by name ("" or the served
    # model's own name: the default); rank 0 resolves it (megascore.api.served_models): the
    # step's header names the set, the input adapter the adapter's slot
    Option("model", "", rules.same, rules.check_version, str, flag=False, broadcast=False),
    # a second weight set scored on the same tokens (megascore.api.reference_kl); its
    # logprobs reach the step under `model` as the input reference_logprobs
    Option("reference", "", rules.same, rules.check_version, str, flag=False, broadcast=False),
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
    Input("loss_mask", TOKEN, "uint8", fill=1, reference=True),
    Input(
        "temperature",
        SEQUENCE,
        "float32",
        fill=1.0,
        check=_between(FLOAT32_TINY, FLOAT32_MAX, "must be finite and > 0 (a float32)"),
        reference=True,
    ),
    Input("routing", TOKEN, "int32", ndim=2, reference=True),
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
    Input("score_from", SEQUENCE, "int64", fill=0, check=_whole_numbers, reference=True),
    # the logprobs of the tokens under the request's reference set (options.reference),
    # from the engine's step under it (megascore.api.reference_step)
    Input("reference_logprobs", TOKEN, "float32", fill=0.0, wire=False),
    # the LoRA adapter slot each sequence is scored with (-1: the weight set alone), from
    # the adapter its request's model names (megascore.engine.weights.adapters)
    Input("adapter", SEQUENCE, "int64", fill=-1, wire=False),
)


# ---- outputs --------------------------------------------------------------------------------


def _routes(batch, values: dict) -> np.ndarray:
    """The routing of each token: the replayed routes of the request, else those the
    step recorded (``values["routing"]``, already in the flat layout)."""
    if batch.routing is not None:
        return np.asarray(batch.routing, dtype=np.int32)
    return values["routing"]


def _with_reference(options) -> bool:
    """A request naming a reference set (rank 0, the server, the client), or a step that
    carries its logprobs (every rank: the option is rank 0's only)."""
    named = bool(getattr(options, "reference", ""))
    return named or getattr(options, "reference_logprobs", None) is not None


def _kl_per_token(name: str) -> Output:
    """The per-token estimator ``name`` of :mod:`megascore.api.reference_kl`."""
    return Output(
        f"kl_{name}",
        TOKEN,
        "float64",
        f"kl_{name}",
        f"kl_{name}",
        wanted=_with_reference,
        finish=lambda batch, values: reference_kl.per_token(
            values["logprobs"], batch.reference_logprobs, batch.lengths
        )[name],
        needs=("logprobs",),
    )


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
        "reference_logprobs",
        TOKEN,
        "float32",
        "reference_logprobs",
        "reference_logprobs",
        wanted=_with_reference,
        finish=lambda batch, values: np.asarray(batch.reference_logprobs, np.float32),
    ),
    *(_kl_per_token(name) for name in reference_kl.NAMES),
    Output(
        "kl",
        SEQUENCE,
        "float64",
        "kl",
        "kl_mean",
        wanted=_with_reference,
        keys=lambda o: reference_kl.NAMES,
        finish=lambda batch, values: reference_kl.means(
            values["logprobs"], batch.reference_logprobs, batch.lengths, batch.scored_mask()
        ),
        needs=("logprobs",),
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

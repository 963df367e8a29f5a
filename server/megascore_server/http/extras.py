"""The ``megascore`` key of an HTTP request and answer, read from the table.

Request: ``"megascore": {<option>: value, <input>: per-prompt values}`` — every option of
:data:`megascore.api.schema.OPTIONS` by its name (an enum option by its name:
``"logprob_positions": "masked"``) and every input of :data:`megascore.api.schema.INPUTS`:
a per-token input as one list per prompt (``"loss_mask": [[0, 1, 1], [0, 1]]``,
``"target_ids": [[[3, 4], [5, 6]], ...]``), a per-sequence one as one value for every
prompt or one per prompt (``"mismatch_ratio_cap": 3.0``, ``"score_from": [0, 5]``; sequence i
is prompt i).

Answer: each choice's ``"megascore"`` holds every output of
:data:`megascore.api.schema.OUTPUTS` the request asked for, by its SDK name (per token: one
list, entry 0 the fill; per sequence: the value or row; a map: name -> value), and the
response's ``"megascore"`` the weights version (and the reference set's, with
``reference``), the MoE / MTP metrics and the timings.
No list of fields lives here: a new entry of the table is reachable over HTTP as it is.
"""

from __future__ import annotations

import numpy as np

from megascore.api import schema
from megascore.api.errors import InvalidRequestError
from megascore_server.service import Scored

_TYPES = {bool: "a boolean", int: "an integer", str: "a string", tuple: "a list of strings"}


def _option(opt: schema.Option, value, field: str):
    if opt.names is not None:
        if not isinstance(value, str) or value not in opt.names:
            raise InvalidRequestError(f"{field}: {value!r} is not one of {sorted(opt.names)}")
        return opt.names[value]
    kind = type(opt.default)
    ok = (
        isinstance(value, list) and all(isinstance(v, str) for v in value)
        if kind is tuple
        else isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    )
    if not ok:
        raise InvalidRequestError(f"{field}: must be {_TYPES[kind]}, got {type(value).__name__}")
    return opt.convert(tuple(value) if kind is tuple else value)


def _rows(spec: schema.Input, value, lengths: np.ndarray, field: str) -> np.ndarray:
    """A per-token input: one list of ``length`` rows per prompt, concatenated."""
    if not isinstance(value, list) or len(value) != lengths.size:
        raise InvalidRequestError(
            f"{field}: must be a list of {lengths.size} lists (one per prompt)"
        )
    parts = []
    for i, (rows, length) in enumerate(zip(value, lengths, strict=True)):
        try:
            part = np.asarray(rows, dtype=spec.dtype)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidRequestError(f"{field}[{i}]: not {spec.dtype} values ({exc})") from None
        if part.ndim != 1 + spec.ndim or part.shape[0] != length:
            raise InvalidRequestError(
                f"{field}[{i}]: {part.shape[0] if part.ndim else 0} rows of {part.ndim - 1} "
                f"dims, expected {int(length)} rows of {spec.ndim} (one per token)"
            )
        parts.append(part)
    return np.concatenate(parts)


def _per_sequence(spec: schema.Input, value, num: int, field: str) -> np.ndarray:
    values = value if isinstance(value, list) else [value] * num
    if len(values) != num or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
    ):
        raise InvalidRequestError(f"{field}: must be a number, or one number per prompt")
    if np.dtype(spec.dtype).kind in "iu":  # an integer input: never truncate a fraction
        for i, v in enumerate(values):
            if isinstance(v, float) and not v.is_integer():
                raise InvalidRequestError(f"{field}: sequence {i}: {v!r} is not an integer")
    try:
        with np.errstate(over="ignore"):
            out = np.asarray(values, dtype=spec.dtype)
    except OverflowError:
        out = np.array([np.inf])
    if not np.all(np.isfinite(out)):
        raise InvalidRequestError(f"{field}: must be finite in {spec.dtype}")
    return out


def read(extras, lengths: np.ndarray, key: str = "megascore") -> dict:
    """``ScoreBatch`` keyword arguments from a request's ``megascore`` object.

    Raises:
        InvalidRequestError: an unknown key or a value of the wrong type or size,
            naming ``megascore.<key>`` (and the prompt).
    """
    if extras is None:
        return {}
    if not isinstance(extras, dict):
        raise InvalidRequestError(f"{key}: must be an object")
    options = {opt.name: opt for opt in schema.OPTIONS}
    inputs = {spec.name: spec for spec in schema.INPUTS if spec.wire}
    kwargs = {}
    for name, value in extras.items():
        field = f"{key}.{name}"
        if name in options:
            kwargs[name] = _option(options[name], value, field)
        elif name in inputs and inputs[name].per == schema.TOKEN:
            kwargs[name] = _rows(inputs[name], value, lengths, field)
        elif name in inputs:
            kwargs[name] = _per_sequence(inputs[name], value, lengths.size, field)
        else:
            known = ", ".join(sorted([*options, *inputs]))
            raise InvalidRequestError(f"{field}: unknown key (known: {known})")
    return kwargs


def outputs(scored: Scored, offsets: np.ndarray, index: int) -> dict:
    """Every output of the table prompt ``index`` asked for, by its SDK name."""
    batch, values = scored.batch, scored.output.values
    start, end = int(offsets[index]), int(offsets[index + 1])
    out = {}
    for spec in schema.OUTPUTS:
        if not spec.wanted(batch) or spec.name not in values:
            continue
        value = values[spec.name]
        if spec.keys is not None:
            out[spec.sdk] = {name: value[name][index] for name in spec.keys(batch)}
        elif spec.per == schema.TOKEN:
            out[spec.sdk] = np.ascontiguousarray(value[start:end])
        else:
            out[spec.sdk] = np.asarray(value)[index]
    return out


def reference_version(scored: Scored) -> dict:
    """``{"reference_weights_version": ...}`` when the request named a ``reference``."""
    if not scored.batch.reference:
        return {}
    return {"reference_weights_version": scored.output.reference_weights_version}


def summary(scored: Scored) -> dict:
    """The response-wide part: weights version (and the reference's, with ``reference``),
    metrics of the forward, timings."""
    body = {
        "weights_version": scored.output.weights_version,
        **reference_version(scored),
        "timings": {
            "queue_ms": scored.queue_ms,
            "compute_ms": scored.compute_ms,
            "total_ms": scored.total_ms,
            "num_steps": scored.num_steps,
        },
    }
    if scored.batch.return_moe_metrics:
        body["moe_metrics"] = scored.output.moe_metrics
    if scored.batch.return_mtp_metrics:
        body["mtp_metrics"] = scored.output.mtp_metrics
    return body

"""The wire gate of rank 0: a request's checks, for every front.

:func:`check_request` is the domain half: it checks a :class:`ScoreBatch` however
it was decoded (gRPC's ``ScoreRequest``, an HTTP body) and is what the scoring
service runs on every request (``megascore_server.service``).
:func:`validate_request` is gRPC's decoding half: ``ScoreRequest`` ->
:class:`ScoreBatch` (dtypes, required fields, groups), then the domain checks.

Nothing reaches the batcher (and so the workers) before it passed here. Every
error names the offending field and, where there is one, the sequence index
(and token position). Checks are vectorised numpy: a 1M-token request costs a
few milliseconds.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from megascore.api import layout, mismatch, schema
from megascore.api.errors import InvalidRequestError, RequestTooLargeError, quoted
from megascore.api.limits import (
    Limits,
    RoutingShape,
    check_lengths,
    check_options,
    check_token_ids,
    score_from_problem,
)
from megascore.api.schema import MAX_ID_CHARS
from megascore.api.types import ScoreBatch, check_routing, check_scored_inputs
from megascore.api.wire import decode_array
from megascore.v1 import scoring_pb2 as pb
from megascore_server.prompt_expansion import expand_groups

logger = logging.getLogger(__name__)

_INT_DTYPES = (pb.DTYPE_INT32, pb.DTYPE_INT64)
_MASK_DTYPES = (pb.DTYPE_UINT8, pb.DTYPE_INT32, pb.DTYPE_INT64)
_FLOAT_DTYPES = (pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT64)
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)
_FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_MODEL_CHARS = 4096
"""Longest ``LoadWeightsRequest.model`` accepted (a path of up to PATH_MAX)."""


def check_length(field: str, text: str, limit: int) -> None:
    """The one check of an id-like string (request id, weights version, model path).

    Raises:
        InvalidRequestError: ``text`` longer than ``limit``, naming ``field``.
    """
    if len(text) > limit:
        raise InvalidRequestError(
            f"{field}: {len(text)} characters, more than {limit} ({quoted(text)})"
        )


def _decode_required(request: pb.ScoreRequest, field: str, allowed) -> np.ndarray:
    if not request.HasField(field):
        raise InvalidRequestError(f"{field}: required field is not set")
    return decode_array(getattr(request, field), field, allowed)


def validate_lengths(lengths: np.ndarray, limits: Limits) -> np.ndarray:
    """Checks per-sequence lengths (:func:`~megascore.api.limits.check_lengths`) and the
    request's token total; returns them as int64.

    Raises:
        InvalidRequestError: empty batch, a length < 1 or above the maximum.
        RequestTooLargeError: total tokens above ``max_request_tokens``.
    """
    lengths = lengths.astype(np.int64, copy=False)
    check_lengths(lengths, limits)
    total = int(lengths.sum())  # no overflow: each length <= max_sequence_length
    if limits.max_request_tokens is not None and total > limits.max_request_tokens:
        raise RequestTooLargeError(
            f"lengths: request has {total} tokens, more than max_request_tokens "
            f"{limits.max_request_tokens}; split it into several requests"
        )
    return lengths


def validate_loss_mask(mask: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Checks a loss mask has one 0/1 entry per token; returns it as uint8.

    Raises:
        InvalidRequestError: wrong length, or the sequence / position of a non-0/1 value.
    """
    num_tokens = int(offsets[-1])
    if mask.size != num_tokens:
        raise InvalidRequestError(
            f"loss_mask: has {mask.size} entries, expected {num_tokens} (one per token)"
        )
    bad = np.flatnonzero((mask != 0) & (mask != 1))
    if bad.size:
        pos = int(bad[0])
        seq = layout.sequence_at(offsets, pos)
        at = pos - int(offsets[seq])
        raise InvalidRequestError(
            f"loss_mask: sequence {seq} position {at} has value {int(mask[pos])}; "
            "values must be 0 or 1"
        )
    return mask.astype(np.uint8, copy=False)


def check_scalar_input(name: str, value: float, field: str) -> float:
    """A per-request value of input ``name`` (``temperature``, ``mismatch_ratio_cap``),
    checked by the table's one check of it (:func:`megascore.api.schema.check_input`).

    Raises:
        InvalidRequestError: naming ``field``.
    """
    rule = schema.check_input(name, value)
    if rule is not None:
        raise InvalidRequestError(f"{field}: {value} is invalid; it {rule}")
    return float(value)


def check_score_from(values, lengths: np.ndarray) -> np.ndarray:
    """Checks ``score_from`` (:func:`megascore.api.limits.score_from_problem`); returns it
    as int64.

    Raises:
        InvalidRequestError: naming ``score_from`` and the first sequence that breaks it.
    """
    problem = score_from_problem(values, lengths)
    if problem is not None:
        raise InvalidRequestError(problem)
    return np.asarray(values).astype(np.int64)


def validate_options(options: pb.ScoreOptions, limits: Limits) -> dict:
    """Checks ``ScoreOptions`` (:func:`~megascore.api.limits.check_options`, the table's
    checks); returns the matching :class:`ScoreBatch` keyword arguments.

    Raises:
        InvalidRequestError: an option out of range, a bad temperature, an unknown loss.
    """
    check_options(options, limits)
    kwargs = {opt.name: opt.convert(getattr(options, opt.name)) for opt in schema.OPTIONS}
    kwargs["temperature"] = 1.0
    if options.HasField("temperature"):
        kwargs["temperature"] = check_scalar_input(
            "temperature", options.temperature, "options.temperature"
        )
    kwargs["mismatch_ratio_cap"] = mismatch.DEFAULT_RATIO_CAP
    if options.HasField("mismatch_ratio_cap"):
        kwargs["mismatch_ratio_cap"] = check_scalar_input(
            "mismatch_ratio_cap", options.mismatch_ratio_cap, "options.mismatch_ratio_cap"
        )
    return kwargs


def decode_routing(request: pb.ScoreRequest, num_tokens: int, shape: RoutingShape | None):
    """The request's routing to replay as int32 ``[T, L, k]`` (flat when its size does not
    fit: :func:`~megascore.api.types.check_routing` then names the shape), or None."""
    if not request.HasField("routing"):
        return None
    routing = decode_array(request.routing, "routing", _INT_DTYPES)
    if shape is not None and routing.size == num_tokens * shape.num_moe_layers * shape.topk:
        routing = routing.reshape(num_tokens, shape.num_moe_layers, shape.topk)
    return routing


def validate_request(request: pb.ScoreRequest, limits: Limits) -> ScoreBatch:
    """Decodes a gRPC request into the engine's :class:`ScoreBatch`, checked
    (:func:`check_request`).

    Args:
        request: the wire request.
        limits: the server's limits.

    Returns:
        A batch holding only this request's sequences (int64 ids and lengths,
        uint8 mask or None, one float32 temperature per sequence).

    Raises:
        InvalidRequestError: anything malformed (names the field and sequence index).
        RequestTooLargeError: more than ``max_request_tokens`` tokens.
    """
    check_length("request_id", request.request_id, MAX_ID_CHARS)
    options = validate_options(request.options, limits)
    lengths = validate_lengths(_decode_required(request, "lengths", _INT_DTYPES), limits)
    if request.HasField("groups"):  # from here on, the request as sent without groups
        request = expand_groups(request, lengths)
    ids = _decode_required(request, "token_ids", _INT_DTYPES)
    mask = None
    if request.HasField("loss_mask"):
        mask = decode_array(request.loss_mask, "loss_mask", _MASK_DTYPES)
    temperature = np.full(lengths.size, options.pop("temperature"), dtype=np.float32)
    cap = options.pop("mismatch_ratio_cap")
    routing = decode_routing(request, ids.size, limits.routing)
    target_ids = rollout = None
    if request.HasField("target_ids"):
        target_ids = decode_array(request.target_ids, "target_ids", _INT_DTYPES)
        if target_ids.size and target_ids.size % ids.size == 0:  # else the check names it
            target_ids = target_ids.reshape(ids.size, -1)
    if request.HasField("rollout_logprobs"):
        rollout = decode_array(request.rollout_logprobs, "rollout_logprobs", _FLOAT_DTYPES)
    score_from = None
    if request.HasField("score_from"):
        score_from = decode_array(request.score_from, "score_from", _INT_DTYPES)
    batch = ScoreBatch(
        token_ids=ids,
        lengths=lengths,
        loss_mask=mask,
        temperature=temperature,
        routing=routing,
        target_ids=target_ids,
        rollout_logprobs=rollout,
        mismatch_ratio_cap=None if rollout is None else np.full(lengths.size, cap, np.float32),
        score_from=score_from,
        **options,
    )
    return check_request(batch, limits)


def check_request(batch: ScoreBatch, limits: Limits) -> ScoreBatch:
    """The domain checks of one request, whichever front decoded it: lengths and the
    request's size, ids, loss mask, options, routing, target ids, rollout logprobs and
    ``score_from``; returns the batch with its arrays in the engine's dtypes.

    Raises:
        InvalidRequestError: naming the field and the sequence (and position).
        RequestTooLargeError: more than ``max_request_tokens`` tokens.
    """
    lengths = validate_lengths(np.asarray(batch.lengths), limits)
    ids = np.asarray(batch.token_ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise InvalidRequestError(f"token_ids: must be 1-D integers, got {ids.dtype} {ids.shape}")
    if limits.max_request_tokens is not None and ids.size > limits.max_request_tokens:
        raise RequestTooLargeError(
            f"token_ids: request has {ids.size} tokens, more than max_request_tokens "
            f"{limits.max_request_tokens}"
        )
    offsets = layout.offsets(lengths)
    if ids.size != int(offsets[-1]):
        raise InvalidRequestError(
            f"token_ids: has {ids.size} ids but lengths sum to {int(offsets[-1])} "
            f"over {lengths.size} sequences"
        )
    check_token_ids(ids, offsets, limits)
    mask = batch.loss_mask
    if mask is not None:
        mask = validate_loss_mask(np.asarray(mask), offsets)
    check_options(batch, limits)
    check_routing(batch, limits)  # names the field and the sequence
    check_scored_inputs(batch, limits)
    score_from = batch.score_from
    if score_from is not None:
        score_from = check_score_from(score_from, lengths)
    routing, target_ids, rollout = batch.routing, batch.target_ids, batch.rollout_logprobs
    return dataclasses.replace(
        batch,
        score_from=score_from,
        token_ids=ids.astype(np.int64, copy=False),
        lengths=lengths,
        loss_mask=mask,
        routing=None if routing is None else np.asarray(routing).astype(np.int32, copy=False),
        target_ids=None if target_ids is None else np.asarray(target_ids).astype(np.int64),
        rollout_logprobs=None if rollout is None else np.asarray(rollout, dtype=np.float64),
    )


def check_load(model: str, weights_version: str, weight_set: str = "", adapter: str = "") -> None:
    """Checks a weight load's arguments before anything is loaded.

    Raises:
        InvalidRequestError: no model, or a string longer than its limit.
    """
    if not model:
        raise InvalidRequestError(
            "model: required (an adapter's directory, or 'hf:DIR', 'megatron:DIR' or "
            "'builtin:NAME@SEED')"
        )
    check_length("model", model, MAX_MODEL_CHARS)
    named = {"weights_version": weights_version, "weight_set": weight_set, "adapter": adapter}
    for field, value in named.items():
        check_length(field, value, MAX_ID_CHARS)

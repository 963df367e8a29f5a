"""Validates a ``ScoreRequest`` on rank 0 and turns it into a :class:`ScoreBatch`.

Nothing reaches the batcher (and so the workers) before it passed here. Every
error names the offending field and, where there is one, the sequence index
(and token position). Checks are vectorised numpy: a 1M-token request costs a
few milliseconds.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np

from megascore import layout
from megascore.errors import InvalidRequestError, ResourceExhaustedError
from megascore.types import RoutingShape, ScoreBatch, check_routing_request
from megascore.v1 import scoring_pb2 as pb
from megascore.wire import decode_array
from megascore_server.status import quoted

logger = logging.getLogger(__name__)

_INT_DTYPES = (pb.DTYPE_INT32, pb.DTYPE_INT64)
_MASK_DTYPES = (pb.DTYPE_UINT8, pb.DTYPE_INT32, pb.DTYPE_INT64)
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)
_FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_ID_CHARS = 256
"""Longest ``request_id`` / ``weights_version`` accepted."""
MAX_MODEL_CHARS = 4096
"""Longest ``LoadWeightsRequest.model`` accepted (a path of up to PATH_MAX)."""


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What a request must respect (the server's view of the model and its limits)."""

    vocab_size: int
    max_sequence_length: int
    max_request_tokens: int
    max_top_k: int
    loss_names: frozenset[str]
    routing: RoutingShape | None = None
    """The model's MoE routing shape; None: no MoE layers (routing is refused)."""
    metric_groups: frozenset[str] = frozenset()
    """Metric groups the model reports ("moe", "mtp"; none for a dense model); asking
    for another is refused, like routing on a dense model."""


def _locate(offsets: np.ndarray, position: int) -> tuple[int, int]:
    """Sequence index and position inside it of flat token ``position``."""
    seq = int(np.searchsorted(offsets, position, side="right")) - 1
    return seq, position - int(offsets[seq])


def _check_length(field: str, text: str, limit: int) -> None:
    if len(text) > limit:
        raise InvalidRequestError(
            f"{field}: {len(text)} characters, more than {limit} ({quoted(text)})"
        )


def _decode_required(request: pb.ScoreRequest, field: str, allowed) -> np.ndarray:
    if not request.HasField(field):
        raise InvalidRequestError(f"{field}: required field is not set")
    return decode_array(getattr(request, field), field, allowed)


def validate_lengths(lengths: np.ndarray, limits: RequestLimits) -> np.ndarray:
    """Checks per-sequence lengths; returns them as int64.

    Raises:
        InvalidRequestError: empty batch, a length < 1 or above the maximum.
        ResourceExhaustedError: total tokens above ``max_request_tokens``.
    """
    if lengths.size == 0:
        raise InvalidRequestError("lengths: empty batch (at least one sequence is required)")
    lengths = lengths.astype(np.int64, copy=False)
    bad = np.flatnonzero(lengths < 1)
    if bad.size:
        i = int(bad[0])
        raise InvalidRequestError(
            f"lengths: sequence {i} has length {int(lengths[i])}; every length must be >= 1"
        )
    bad = np.flatnonzero(lengths > limits.max_sequence_length)
    if bad.size:
        i = int(bad[0])
        raise InvalidRequestError(
            f"lengths: sequence {i} has length {int(lengths[i])}, longer than "
            f"max_sequence_length {limits.max_sequence_length}"
        )
    total = int(lengths.sum())  # no overflow: each length <= max_sequence_length
    if total > limits.max_request_tokens:
        raise ResourceExhaustedError(
            f"lengths: request has {total} tokens, more than max_request_tokens "
            f"{limits.max_request_tokens}; split it into several requests"
        )
    return lengths


def validate_token_ids(ids: np.ndarray, offsets: np.ndarray, vocab_size: int) -> np.ndarray:
    """Checks every id is in ``[0, vocab_size)``; returns int64 ids.

    Raises:
        InvalidRequestError: naming the sequence index and position of the first bad id.
    """
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        pos = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])
        seq, at = _locate(offsets, pos)
        raise InvalidRequestError(
            f"token_ids: sequence {seq} position {at} has id {int(ids[pos])}, "
            f"outside [0, {vocab_size})"
        )
    return ids.astype(np.int64, copy=False)


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
        seq, at = _locate(offsets, pos)
        raise InvalidRequestError(
            f"loss_mask: sequence {seq} position {at} has value {int(mask[pos])}; "
            "values must be 0 or 1"
        )
    return mask.astype(np.uint8, copy=False)


def validate_options(options: pb.ScoreOptions, limits: RequestLimits) -> dict:
    """Checks ``ScoreOptions``; returns the matching :class:`ScoreBatch` keyword arguments.

    Raises:
        InvalidRequestError: top_k out of range, bad temperature, unknown loss, metrics
            the model does not report (MoE metrics of a dense model, MTP metrics of a
            model without MTP layers).
    """
    for group, asked in (("moe", options.return_moe_metrics), ("mtp", options.return_mtp_metrics)):
        if asked and group not in limits.metric_groups:
            what = "MoE layers" if group == "moe" else "MTP layers"
            raise InvalidRequestError(
                f"options.return_{group}_metrics: the served model has no {what} "
                f"(GetModelInfo {group}_metric_names is empty)"
            )
    if options.top_k < 0 or options.top_k > limits.max_top_k:
        raise InvalidRequestError(
            f"options.top_k: {options.top_k} is outside [0, max_top_k={limits.max_top_k}]"
        )
    temperature = 1.0
    if options.HasField("temperature"):
        temperature = options.temperature
        if not (math.isfinite(temperature) and _FLOAT32_TINY <= temperature <= _FLOAT32_MAX):
            raise InvalidRequestError(
                f"options.temperature: {temperature} is invalid; it must be finite and > 0 "
                "(representable as float32)"
            )
    losses: list[str] = []
    for i, name in enumerate(options.losses):
        if name not in limits.loss_names:
            known = ", ".join(sorted(limits.loss_names)) or "none"
            raise InvalidRequestError(
                f"options.losses[{i}]: unknown loss {quoted(name)} (available: {known})"
            )
        if name not in losses:
            losses.append(name)
    return {
        "temperature": temperature,
        "top_k": int(options.top_k),
        "losses": tuple(losses),
        "want_logprobs": bool(options.return_logprobs),
        "want_moe_metrics": bool(options.return_moe_metrics),
        "want_mtp_metrics": bool(options.return_mtp_metrics),
        "want_routing": bool(options.return_routing),
    }


def decode_routing(request: pb.ScoreRequest, num_tokens: int, shape: RoutingShape | None):
    """The request's routing to replay as ``[T, L, k]`` (flat when its size does not fit:
    :func:`~megascore.types.check_routing_request` then names the shape), or None."""
    if not request.HasField("routing"):
        return None
    routing = decode_array(request.routing, "routing", _INT_DTYPES)
    if shape is not None and routing.size == num_tokens * shape.num_moe_layers * shape.topk:
        routing = routing.reshape(num_tokens, shape.num_moe_layers, shape.topk)
    return routing


def validate_request(request: pb.ScoreRequest, limits: RequestLimits) -> ScoreBatch:
    """Validates a request and converts it into the engine's :class:`ScoreBatch`.

    Args:
        request: the wire request.
        limits: the server's limits.

    Returns:
        A batch holding only this request's sequences (int64 ids and lengths,
        uint8 mask or None, one float32 temperature per sequence).

    Raises:
        InvalidRequestError: anything malformed (names the field and sequence index).
        ResourceExhaustedError: more than ``max_request_tokens`` tokens.
    """
    _check_length("request_id", request.request_id, MAX_ID_CHARS)
    options = validate_options(request.options, limits)
    lengths = validate_lengths(_decode_required(request, "lengths", _INT_DTYPES), limits)
    ids = _decode_required(request, "token_ids", _INT_DTYPES)
    if ids.size > limits.max_request_tokens:
        raise ResourceExhaustedError(
            f"token_ids: request has {ids.size} tokens, more than max_request_tokens "
            f"{limits.max_request_tokens}"
        )
    offsets = layout.offsets(lengths)
    if ids.size != int(offsets[-1]):
        raise InvalidRequestError(
            f"token_ids: has {ids.size} ids but lengths sum to {int(offsets[-1])} "
            f"over {lengths.size} sequences"
        )
    ids = validate_token_ids(ids, offsets, limits.vocab_size)
    mask = None
    if request.HasField("loss_mask"):
        raw = decode_array(request.loss_mask, "loss_mask", _MASK_DTYPES)
        mask = validate_loss_mask(raw, offsets)
    temperature = np.full(lengths.size, options.pop("temperature"), dtype=np.float32)
    routing = decode_routing(request, ids.size, limits.routing)
    batch = ScoreBatch(
        token_ids=ids,
        lengths=lengths,
        loss_mask=mask,
        temperature=temperature,
        routing=routing,
        **options,
    )
    check_routing_request(batch, limits.routing)  # names the field and the sequence
    if routing is not None:
        batch = dataclasses.replace(batch, routing=routing.astype(np.int32, copy=False))
    return batch


def validate_load_request(request: pb.LoadWeightsRequest) -> None:
    """Checks a ``LoadWeightsRequest`` before anything is loaded.

    Raises:
        InvalidRequestError: no model, or a string field longer than its limit.
    """
    if not request.model:
        raise InvalidRequestError(
            "model: required ('hf:DIR', 'megatron:DIR' or 'builtin:NAME@SEED')"
        )
    _check_length("model", request.model, MAX_MODEL_CHARS)
    _check_length("weights_version", request.weights_version, MAX_ID_CHARS)

"""Expands a request whose sequences come in groups (``ScoreRequest.groups``, each
prompt sent once) into the same request without groups.

The wire gate (:mod:`megascore_server.validation`) runs it first: everything after it
sees every sequence whole, so the batch, its checks and its results are those of the
request sent without groups. Every per-token array the request carries
(:func:`token_fields`: ``token_ids`` and the inputs per token of
:data:`megascore.api.schema.INPUTS`) is expanded by the same index
(:func:`megascore.api.prompt_groups.expand_index`).
"""

from __future__ import annotations

import numpy as np

from megascore.api import schema
from megascore.api.errors import InvalidRequestError
from megascore.api.prompt_groups import expand_index
from megascore.api.wire import decode_array, encode_array
from megascore.v1 import scoring_pb2 as pb

_INT_DTYPES = (pb.DTYPE_INT32, pb.DTYPE_INT64)


def token_fields() -> tuple[str, ...]:
    """The ``ScoreRequest`` arrays with one row per token, those a group's prompt
    shares: ``token_ids`` and the inputs per token of :data:`megascore.api.schema.INPUTS`."""
    return ("token_ids", *(spec.name for spec in schema.INPUTS if spec.per == schema.TOKEN))


def _counts(groups: pb.SequenceGroups, field: str) -> np.ndarray:
    if not groups.HasField(field):
        raise InvalidRequestError(f"groups.{field}: required field is not set")
    return decode_array(getattr(groups, field), f"groups.{field}", _INT_DTYPES).astype(np.int64)


def _refuse_first(bad: np.ndarray, message) -> None:
    """Raises ``InvalidRequestError(message(i))`` for the first ``i`` where ``bad`` holds."""
    hits = np.flatnonzero(bad)
    if hits.size:
        raise InvalidRequestError(message(int(hits[0])))


def _check_groups(sizes: np.ndarray, prompts: np.ndarray, lengths: np.ndarray) -> None:
    """Raises InvalidRequestError naming the field and the group / sequence."""
    if prompts.size != sizes.size:
        raise InvalidRequestError(
            f"groups.prompt_lengths: {prompts.size} entries for {sizes.size} groups (groups.sizes)"
        )
    _refuse_first(
        sizes < 1,
        lambda g: f"groups.sizes: group {g} has {int(sizes[g])} sequences; every group needs >= 1",
    )
    _refuse_first(  # bounded before the sum, which could otherwise wrap around
        sizes > lengths.size,
        lambda g: (
            f"groups.sizes: group {g} has {int(sizes[g])} sequences, lengths has {lengths.size}"
        ),
    )
    if int(sizes.sum()) != lengths.size:
        raise InvalidRequestError(
            f"groups.sizes: the groups hold {int(sizes.sum())} sequences, lengths has "
            f"{lengths.size}"
        )
    _refuse_first(
        prompts < 0,
        lambda g: f"groups.prompt_lengths: group {g} has a prompt of {int(prompts[g])} tokens",
    )
    group_of = np.repeat(np.arange(sizes.size), sizes)
    _refuse_first(
        prompts[group_of] > lengths,
        lambda i: (
            f"groups.prompt_lengths: group {group_of[i]}'s prompt has "
            f"{int(prompts[group_of[i]])} tokens, more than its sequence {i} "
            f"(length {int(lengths[i])})"
        ),
    )


def expand_groups(request: pb.ScoreRequest, lengths: np.ndarray) -> pb.ScoreRequest:
    """The request without groups: every per-token array in the full layout.

    Args:
        request: a request with ``groups`` set.
        lengths: its checked int64 full sequence lengths.

    Returns:
        A new request, ``groups`` cleared, the other fields as sent.

    Raises:
        InvalidRequestError: malformed groups, or a per-token array whose size does not
            fit the tokens sent (naming the field, and the group or sequence).
    """
    sizes = _counts(request.groups, "sizes")
    prompts = _counts(request.groups, "prompt_lengths")
    _check_groups(sizes, prompts, lengths)
    index = expand_index(lengths, sizes, prompts)
    sent = int(prompts.sum() + (lengths - np.repeat(prompts, sizes)).sum())
    expanded = pb.ScoreRequest()
    per_token = token_fields()
    for field, value in request.ListFields():
        if field.name == "groups":
            continue
        if field.name not in per_token:
            if field.message_type is None:
                setattr(expanded, field.name, value)
            else:
                getattr(expanded, field.name).CopyFrom(value)
            continue
        rows = decode_array(value, field.name)
        # token_ids: one id per token sent; the others: whole rows per token
        fits = rows.size == sent if field.name == "token_ids" else rows.size % sent == 0
        if not fits:
            raise InvalidRequestError(
                f"{field.name}: has {rows.size} values for the {sent} tokens sent (groups: "
                "each prompt once, then every sequence past its prompt)"
            )
        getattr(expanded, field.name).CopyFrom(encode_array(rows.reshape(sent, -1)[index]))
    return expanded

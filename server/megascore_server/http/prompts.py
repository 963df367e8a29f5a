"""Prompts of an HTTP body -> one :class:`~megascore.api.types.ScoreBatch` (both dialects).

A prompt is token ids or text (tokenized with the server's tokenizer); every error
names the dialect's field and the prompt index (``prompt[2]``, ``input_ids[0][7]``).
The ids are range-checked by the service (:func:`~megascore_server.validation.check_request`),
whose "sequence i" is prompt i.
"""

from __future__ import annotations

import itertools
from typing import Annotated

import numpy as np
from pydantic import Field, StrictInt, StrictStr

from megascore.api import schema
from megascore.api.errors import InvalidRequestError
from megascore.api.layout import effective_loss_mask
from megascore.api.types import ScoreBatch
from megascore_server.http import extras
from megascore_server.http.bodies import IdArrays
from megascore_server.tokenizer import ServerTokenizer, require

# Left to right, ids first: pydantic's default ("smart") union tries every alternative
# on every element, and a body of a million ids took 1 s in the list[str] one alone.
# The alternatives exclude each other (strict types), so the first that fits is the one.
IdPrompts = Annotated[list[StrictInt] | list[list[StrictInt]], Field(union_mode="left_to_right")]
"""Token ids: one prompt or a list of them."""
Prompts = Annotated[
    list[StrictInt] | list[list[StrictInt]] | StrictStr | list[StrictStr],
    Field(union_mode="left_to_right"),
]
"""Token ids or text: one prompt or a list of them."""


def token_lists(
    value, field: str, tokenizer: ServerTokenizer | None, add_special_tokens: bool
) -> tuple[list[list[int]], list[str | None], bool]:
    """The prompts of ``value`` (ids, a list of ids, text or a list of text, or
    :class:`IdArrays`) as id lists (arrays for :class:`IdArrays`), the texts given (None
    for id prompts) and whether the body sent several prompts."""
    if isinstance(value, IdArrays):  # a large body's, parsed apart (megascore_server.http.bodies)
        empty = np.flatnonzero(value.lengths == 0)
        if empty.size:
            where = f"{field}[{empty[0]}]" if value.batched else field
            raise InvalidRequestError(f"{where}: empty prompt (at least one token is required)")
        return value.prompts(), [None] * value.lengths.size, value.batched
    if isinstance(value, str):
        value, batched = [value], False
    elif isinstance(value, list) and value and isinstance(value[0], int):
        value, batched = [value], False  # validated: one int means all of them are
    else:
        batched = True
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(f"{field}: at least one prompt is required")
    ids, texts = [], []
    for i, prompt in enumerate(value):
        where = f"{field}[{i}]" if batched else field
        if isinstance(prompt, str):
            prompt_ids = require(tokenizer, where).encode(prompt, add_special_tokens)
            texts.append(prompt)
        else:
            prompt_ids = prompt
            texts.append(None)
        if not prompt_ids:
            raise InvalidRequestError(f"{where}: empty prompt (at least one token is required)")
        ids.append(prompt_ids)
    return ids, texts, batched


def build_batch(ids: list, field: str, megascore, **options) -> ScoreBatch:
    """The batch of ``ids`` (:func:`token_lists`' lists or arrays) with the dialect's
    ``options`` and the ``megascore`` extras.

    ``top_k`` takes the larger; a flag is on when either side asks for it (the dialect's
    answer needs what it asks for); the temperature of the extras wins; an input given
    both ways (``token_ids_logprob`` and ``megascore.target_ids``) is refused; the
    dialect's answer needs the logprobs unless it asks for none (``need_logprobs``).

    Raises:
        InvalidRequestError: ids beyond int64, a bad extra, an input given twice, or
            ``megascore.return_logprobs: false`` where the answer needs logprobs.
    """
    lengths = np.fromiter((len(p) for p in ids), np.int64, len(ids))
    try:
        if isinstance(ids[0], np.ndarray):
            flat = np.concatenate(ids)
        else:
            flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(lengths.sum()))
    except (OverflowError, ValueError) as exc:
        raise InvalidRequestError(f"{field}: token ids must fit in int64 ({exc})") from None
    kwargs = extras.read(megascore, lengths)
    kwargs["top_k"] = max(kwargs.get("top_k", 0), options.pop("top_k", 0))
    temperature = options.pop("temperature", None)
    if "temperature" not in kwargs and temperature is not None:
        kwargs["temperature"] = np.full(lengths.size, temperature, np.float32)
    if options.pop("need_logprobs", True) and kwargs.get("return_logprobs") is False:
        raise InvalidRequestError(
            "megascore.return_logprobs: false, but the answer asked for holds logprobs"
        )
    for name, value in options.items():
        if isinstance(value, bool):
            kwargs[name] = bool(kwargs.get(name)) or value
        elif value is not None and name in kwargs:
            raise InvalidRequestError(f"megascore.{name}: also given by the body's own field")
        elif value is not None:
            kwargs[name] = value
    return ScoreBatch(token_ids=flat, lengths=lengths, **kwargs)


def unscored(batch: ScoreBatch) -> np.ndarray | None:
    """bool ``[T]``: the positions left unscored, which the dialects answer as they answer
    position 0: outside the loss mask under ``logprob_positions: "masked"``, and before
    each sequence's ``score_from``; None when there are none."""
    outside = None
    if batch.logprob_positions == schema.MASKED:
        outside = effective_loss_mask(batch.lengths, batch.loss_mask) == 0
    if batch.score_from is not None and np.any(batch.score_from):
        before = batch.before_score_from()
        outside = before if outside is None else outside | before
    return outside


def temperature_of(value, field: str) -> float | None:
    """A dialect's temperature: None, or 0 (greedy), mean unscaled logprobs."""
    if value is None or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidRequestError(f"{field}: must be a number >= 0, got {value!r}")
    return float(value)

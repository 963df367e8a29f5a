"""Prompts of an HTTP body -> one :class:`~megascore.types.ScoreBatch` (both dialects).

A prompt is token ids or text (tokenized with the server's tokenizer); every error
names the dialect's field and the prompt index (``prompt[2]``, ``input_ids[0][7]``).
The ids are range-checked by the service (:func:`~megascore_server.validation.check_request`),
whose "sequence i" is prompt i.
"""

from __future__ import annotations

import numpy as np

from megascore.errors import InvalidRequestError
from megascore.types import ScoreBatch
from megascore_server.http import extras
from megascore_server.tokenizer import ServerTokenizer, require


def token_lists(
    value, field: str, tokenizer: ServerTokenizer | None, add_special_tokens: bool
) -> tuple[list[list[int]], list[str | None], bool]:
    """The prompts of ``value`` (ids, a list of ids, text or a list of text) as id lists,
    the texts given (None for id prompts) and whether the body sent several prompts."""
    if isinstance(value, str):
        value, batched = [value], False
    elif isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        value, batched = [value], False
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


def build_batch(ids: list[list[int]], field: str, megascore, **options) -> ScoreBatch:
    """The batch of ``ids`` with the dialect's ``options`` and the ``megascore`` extras
    (an extra overrides the dialect's value; ``top_k`` takes the larger)."""
    lengths = np.fromiter((len(p) for p in ids), np.int64, len(ids))
    try:
        flat = np.fromiter((t for p in ids for t in p), np.int64, int(lengths.sum()))
    except (OverflowError, ValueError) as exc:
        raise InvalidRequestError(f"{field}: token ids must fit in int64 ({exc})") from None
    kwargs = extras.read(megascore, lengths)
    kwargs["top_k"] = max(kwargs.get("top_k", 0), options.pop("top_k", 0))
    temperature = options.pop("temperature", None)
    if "temperature" not in kwargs and temperature is not None:
        kwargs["temperature"] = np.full(lengths.size, temperature, np.float32)
    for name, value in options.items():
        kwargs[name] = kwargs.get(name) or value
    return ScoreBatch(token_ids=flat, lengths=lengths, **kwargs)


def temperature_of(value, field: str) -> float | None:
    """A dialect's temperature: None, or 0 (greedy), mean unscaled logprobs."""
    if value is None or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidRequestError(f"{field}: must be a number >= 0, got {value!r}")
    return float(value)

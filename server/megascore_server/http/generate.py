"""``POST /generate`` in the SGLang dialect, scoring only.

``input_ids`` (one list or a batch) or ``text``; ``sampling_params.max_new_tokens`` 0
or 1; ``return_logprob`` with ``logprob_start_len`` (-1: the last input token only, as
SGLang), ``top_logprobs_num``, ``token_ids_logprob``, ``return_text_in_logprobs``.
``meta_info`` holds ``input_token_logprobs`` ``[[logprob | None, id, text | None], ...]``
(None at position 0, which has no prediction), ``input_top_logprobs``,
``input_token_ids_logprobs``, the ``output_*`` ones for a generated token,
``prompt_tokens``, ``cached_tokens`` (the input tokens read from the engine's prefix
cache), ``id`` and megascore's ``weights_version``; megascore's own options and outputs
under the ``megascore`` key (:mod:`megascore_server.http.extras`).

``logprob_start_len`` goes to the engine as ``score_from`` (it computes nothing of the
output head before it, and may take those positions from its prefix cache), unless the
body has a ``megascore`` key: its outputs cover every position, as they always have, and
it may set ``score_from`` itself (the input positions before it are then answered as
position 0 is, with None).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from megascore.api.errors import InvalidRequestError
from megascore_server.http import extras
from megascore_server.http.completions import FLOOR, NO_GENERATION
from megascore_server.http.errors import json_response
from megascore_server.http.prompts import (
    IdPrompts,
    build_batch,
    temperature_of,
    token_lists,
    unscored,
)
from megascore_server.http.tokens import TokenStrings
from megascore_server.service import Scored, ScoringService

FIELDS = {
    "token_ids": "input_ids",
    "lengths": "input_ids",
    "target_ids": "token_ids_logprob",
    "score_from": "megascore.score_from",
}


class GenerateRequest(BaseModel):
    """The fields megascore reads; any other SGLang field is accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    text: StrictStr | list[StrictStr] | None = None
    input_ids: IdPrompts | None = None
    sampling_params: dict[str, Any] | None = None
    return_logprob: StrictBool = False
    logprob_start_len: StrictInt = -1
    top_logprobs_num: StrictInt = 0
    token_ids_logprob: list[StrictInt] | None = None
    return_text_in_logprobs: StrictBool = False
    rid: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    megascore: dict[str, Any] | None = None


def _max_new_tokens(params: dict) -> int:
    value = params.get("max_new_tokens", 0)
    if isinstance(value, bool) or value not in (0, 1):
        raise InvalidRequestError(
            f"sampling_params.max_new_tokens: {value!r}: {NO_GENERATION} (0 or 1)"
        )
    return value


def _prompts(body: GenerateRequest, service: ScoringService):
    if (body.text is None) == (body.input_ids is None):
        raise InvalidRequestError("input_ids: give exactly one of input_ids and text")
    if body.input_ids is not None:
        return token_lists(body.input_ids, "input_ids", None, False)
    return token_lists(body.text, "text", service.tokenizer, True)


async def generate(
    service: ScoringService, body: GenerateRequest, request_id: str, arrival, deadline
):
    """Scores the body's inputs; the SGLang-shaped response (a list for a batch)."""
    if body.stream:
        raise InvalidRequestError(f"stream: {NO_GENERATION}; send stream=false")
    if body.top_logprobs_num < 0:
        raise InvalidRequestError(f"top_logprobs_num: {body.top_logprobs_num} must be >= 0")
    params = body.sampling_params or {}
    max_new = _max_new_tokens(params)
    ids, _, batched = _prompts(body, service)
    rids = body.rid if isinstance(body.rid, list) else [body.rid or request_id] * len(ids)
    if len(rids) != len(ids):
        raise InvalidRequestError(f"rid: {len(rids)} ids for {len(ids)} inputs")
    if body.return_logprob:
        for i, prompt in enumerate(ids):
            if body.logprob_start_len >= len(prompt):
                raise InvalidRequestError(
                    f"logprob_start_len: {body.logprob_start_len} is not below input {i}'s "
                    f"length {len(prompt)}"
                )
    targets = None
    if body.token_ids_logprob:
        k, limit = len(body.token_ids_logprob), service.limits.max_target_ids
        if k > limit:  # before the [tokens, k] array is made
            raise InvalidRequestError(f"token_ids_logprob: {k} ids, more than {limit}")
        try:
            wanted = np.asarray(body.token_ids_logprob, np.int64)
        except OverflowError:
            raise InvalidRequestError("token_ids_logprob: ids must fit in int64") from None
        targets = np.broadcast_to(wanted, (sum(len(p) for p in ids), k))
    score_from = None
    if body.return_logprob and body.megascore is None:  # the engine skips what is not shown
        score_from = np.array([_first(body, len(p)) for p in ids], np.int64)
    batch = build_batch(
        ids,
        "input_ids",
        body.megascore,
        top_k=body.top_logprobs_num if body.return_logprob else 0,
        temperature=temperature_of(params.get("temperature"), "sampling_params.temperature"),
        return_next_token=max_new == 1,
        target_ids=None if targets is None else np.ascontiguousarray(targets),
        score_from=score_from,
        need_logprobs=body.return_logprob,
    )
    scored = await service.score(
        batch, request_id, arrival=arrival, deadline=deadline, front="http"
    )
    strings = TokenStrings(service.tokenizer)
    encoder = _Encoder(body, scored, strings, max_new)
    answers = [encoder.answer(i, prompt, rids[i]) for i, prompt in enumerate(ids)]
    return json_response(answers if batched else answers[0])


def _first(body: GenerateRequest, length: int) -> int:
    """The first input position answered: ``logprob_start_len``, the last one when < 0."""
    return length - 1 if body.logprob_start_len < 0 else body.logprob_start_len


class _Encoder:
    def __init__(self, body: GenerateRequest, scored: Scored, strings: TokenStrings, max_new: int):
        self.body, self.scored, self.strings, self.max_new = body, scored, strings, max_new
        values = scored.output.values
        self.offsets = np.concatenate([[0], np.cumsum(scored.batch.lengths)])
        if "logprobs" in values:
            self.logprobs = np.maximum(values["logprobs"], FLOOR).tolist()
        outside = unscored(scored.batch)  # "masked": unscored positions answered as None
        self.skip = [False] * int(self.offsets[-1]) if outside is None else outside.tolist()
        if scored.batch.top_k:
            self.top_ids = values["top_k_ids"].tolist()
            self.top_lps = np.maximum(values["top_k_logprobs"], FLOOR).tolist()
        if body.token_ids_logprob:
            self.target_lps = np.maximum(values["target_logprobs"], FLOOR).tolist()
        if max_new:
            self.next_ids = values["next_token_ids"].tolist()
            self.next_lps = np.maximum(values["next_token_logprobs"], FLOOR).tolist()

    def _entry(self, lp, token: int) -> list:
        text = self.strings(token) if self.body.return_text_in_logprobs else None
        return [lp, token, text]

    def _entries(self, lps, ids) -> list:
        return [self._entry(lp, t) for lp, t in zip(lps, ids, strict=True)]

    def answer(self, i: int, prompt: list[int], rid: str) -> dict:
        body, start = self.body, int(self.offsets[i])
        output = [self.next_ids[i][0]] if self.max_new else []
        cached = self.scored.output.values.get("cached_tokens")
        meta = {
            "id": rid,
            "finish_reason": {"type": "length", "length": self.max_new},
            "prompt_tokens": len(prompt),
            "completion_tokens": len(output),
            "cached_tokens": 0 if cached is None else int(cached[i]),
            "weights_version": self.scored.output.weights_version,
            **extras.reference_version(self.scored),
        }
        if body.return_logprob:
            meta.update(self._logprobs(i, prompt, start, output))
        if body.megascore is not None:
            meta["megascore"] = extras.outputs(self.scored, self.offsets, i)
        text = (self.strings.text(output) or "") if output else ""
        return {"text": text, "output_ids": output, "meta_info": meta}

    def _logprobs(self, i: int, prompt: list[int], start: int, output: list[int]) -> dict:
        body = self.body
        positions = range(_first(body, len(prompt)), len(prompt))
        # Position 0 has no prediction; "masked" leaves the positions outside the mask.
        live = {t: t > 0 and not self.skip[start + t] for t in positions}
        meta = {
            "input_token_logprobs": [
                self._entry(self.logprobs[start + t] if live[t] else None, prompt[t])
                for t in positions
            ],
            "output_token_logprobs": [self._entry(self.next_lps[i][0], output[0])]
            if output
            else [],
        }
        if body.top_logprobs_num:
            k = body.top_logprobs_num
            meta["input_top_logprobs"] = [
                self._entries(self.top_lps[start + t][:k], self.top_ids[start + t][:k])
                if live[t]
                else None
                for t in positions
            ]
            meta["output_top_logprobs"] = (
                [self._entries(self.next_lps[i][:k], self.next_ids[i][:k])] if output else []
            )
        if body.token_ids_logprob:
            wanted = body.token_ids_logprob
            meta["input_token_ids_logprobs"] = [
                self._entries(self.target_lps[start + t], wanted) if live[t] else None
                for t in positions
            ]
        return meta

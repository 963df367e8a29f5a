"""``POST /v1/completions`` in the OpenAI / vLLM dialect, scoring only.

Decodes the body into the service's batch and encodes its answer as vLLM does:
``echo`` + ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs`` holding the
actual token and the top k, ``text_offset``), ``prompt_logprobs`` (per position the
top k and the actual token, ``{"<id>": {"logprob", "rank", "decoded_token"}}``),
``max_tokens`` 0 or 1 (1: the greedy next token after the prompt, so the arrays have
``len(prompt) + 1`` entries, as lm-eval slices them), ``usage`` (with
``prompt_tokens_details.cached_tokens``: the prompt tokens read from the engine's prefix
cache, summed over the prompts, as vLLM); megascore's own
options and outputs under the ``megascore`` key (:mod:`megascore_server.http.extras`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt

from megascore.api.errors import InvalidRequestError
from megascore_server.http import extras
from megascore_server.http.errors import json_response
from megascore_server.http.prompts import (
    Prompts,
    build_batch,
    temperature_of,
    token_lists,
    unscored,
)
from megascore_server.http.tokens import TokenStrings
from megascore_server.service import Scored, ScoringService

NO_GENERATION = "megascore scores sequences; it does not generate"
FLOOR = -9999.0
"""Logprobs below it are sent as it (vLLM: JSON has no -inf)."""
FIELDS = {
    "token_ids": "prompt",
    "lengths": "prompt",
    "options.top_k": "logprobs",
    "score_from": "megascore.score_from",
}
"""Domain field -> this dialect's, for an error's ``param``."""


class CompletionRequest(BaseModel):
    """The fields megascore reads; any other OpenAI / vLLM field is accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: Prompts
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    max_tokens: StrictInt | None = None
    prompt_logprobs: StrictInt | None = None
    temperature: float | None = None
    seed: int | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    add_special_tokens: StrictBool = True
    return_token_ids: StrictBool = False
    return_tokens_as_token_ids: StrictBool = False
    megascore: dict[str, Any] | None = None


def check(body: CompletionRequest) -> int:
    """The body's scoring-only limits; returns ``max_tokens`` (0 or 1)."""
    max_tokens = 0 if body.max_tokens is None else body.max_tokens
    if max_tokens not in (0, 1):
        raise InvalidRequestError(f"max_tokens: {max_tokens}: {NO_GENERATION} (0 or 1)")
    if body.stream:
        raise InvalidRequestError(f"stream: {NO_GENERATION}; send stream=false")
    if body.n != 1:
        raise InvalidRequestError(f"n: {body.n}: one choice per prompt (n=1)")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(body, name)
        if value is not None and value < 0:
            raise InvalidRequestError(f"{name}: {value} must be >= 0")
    return max_tokens


async def complete(
    service: ScoringService, body: CompletionRequest, request_id: str, arrival, deadline
):
    """Scores the body's prompts; the vLLM-shaped response."""
    max_tokens = check(body)
    ids, texts, _ = token_lists(body.prompt, "prompt", service.tokenizer, body.add_special_tokens)
    k = max(body.logprobs or 0, body.prompt_logprobs or 0)
    batch = build_batch(
        ids,
        "prompt",
        body.megascore,
        top_k=k,
        temperature=temperature_of(body.temperature, "temperature"),
        return_next_token=max_tokens == 1,
        return_token_ranks=body.prompt_logprobs is not None,
        need_logprobs=body.logprobs is not None or body.prompt_logprobs is not None,
        model=body.model or None,  # a weight set, as vLLM names adapters (404 if unknown)
    )
    scored = await service.score(
        batch, request_id, arrival=arrival, deadline=deadline, front="http"
    )
    strings = TokenStrings(service.tokenizer, body.return_tokens_as_token_ids)
    encoder = _Encoder(body, scored, strings, max_tokens)
    choices = [encoder.choice(i, prompt, texts[i]) for i, prompt in enumerate(ids)]
    prompt_tokens = batch.num_tokens
    return json_response(
        {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model or service.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": max_tokens * len(ids),
                "total_tokens": prompt_tokens + max_tokens * len(ids),
                "prompt_tokens_details": {"cached_tokens": cached_tokens(scored)},
            },
            "megascore": extras.summary(scored),
        }
    )


def cached_tokens(scored: Scored) -> int:
    """The request's prompt tokens read from the engine's prefix cache (the sum over its
    prompts; OpenAI's ``usage.prompt_tokens_details.cached_tokens``)."""
    cached = scored.output.values.get("cached_tokens")
    return 0 if cached is None else int(np.sum(cached))


class _Encoder:
    """One choice per prompt from the scored outputs (lists made once per response)."""

    def __init__(self, body: CompletionRequest, scored: Scored, strings: TokenStrings, max_tokens):
        self.body, self.scored, self.strings, self.max_tokens = body, scored, strings, max_tokens
        values = scored.output.values
        self.offsets = np.concatenate([[0], np.cumsum(scored.batch.lengths)])
        num_tokens = int(self.offsets[-1])
        if "logprobs" in values:
            self.logprobs = np.maximum(values["logprobs"], FLOOR).tolist()
        outside = unscored(scored.batch)  # "masked": unscored positions answered as None
        self.skip = [False] * num_tokens if outside is None else outside.tolist()
        self.top_ids, self.top_lps = [[]] * num_tokens, [[]] * num_tokens
        if scored.batch.top_k:
            self.top_ids = values["top_k_ids"].tolist()
            self.top_lps = np.maximum(values["top_k_logprobs"], FLOOR).tolist()
        if body.prompt_logprobs is not None:
            self.ranks = values["token_ranks"].tolist()
        if max_tokens:
            self.next_ids = values["next_token_ids"].tolist()
            self.next_lps = np.maximum(values["next_token_logprobs"], FLOOR).tolist()

    def _top(self, actual: int, actual_lp: float, ids, lps, k: int) -> dict:
        top = {self.strings(actual): actual_lp}
        for token, lp in zip(ids[:k], lps[:k], strict=True):
            top[self.strings(token)] = lp
        return top

    def choice(self, i: int, prompt: list[int], text: str | None) -> dict:
        body, start = self.body, int(self.offsets[i])
        generated = [self.next_ids[i][0]] if self.max_tokens else []
        prompt_text = text if text is not None else (self.strings.text(prompt) or "")
        out_text = (self.strings.text(generated) or "") if generated else ""
        choice = {
            "index": i,
            "text": (prompt_text if body.echo else "") + out_text,
            "logprobs": None if body.logprobs is None else self._logprobs(i, prompt, start),
            "finish_reason": "length",
            "stop_reason": None,
        }
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(prompt, start)
        if body.return_token_ids:
            choice["prompt_token_ids"] = prompt
            choice["token_ids"] = generated
        if body.megascore is not None:
            choice["megascore"] = extras.outputs(self.scored, self.offsets, i)
        return choice

    def _logprobs(self, i: int, prompt: list[int], start: int) -> dict:
        k = self.body.logprobs
        tokens, lps, tops = [], [], []
        if self.body.echo:
            tokens = [self.strings(t) for t in prompt]
            skip = self.skip
            lps = [None] + [
                None if skip[start + t] else self.logprobs[start + t] for t in range(1, len(prompt))
            ]
            tops = [None] + [
                None
                if skip[start + t]
                else self._top(
                    prompt[t], lps[t], self.top_ids[start + t], self.top_lps[start + t], k
                )
                for t in range(1, len(prompt))
            ]
        if self.max_tokens:
            token, lp = self.next_ids[i][0], self.next_lps[i][0]
            tokens.append(self.strings(token))
            lps.append(lp)
            tops.append(self._top(token, lp, self.next_ids[i], self.next_lps[i], k))
        offsets = np.concatenate([[0], np.cumsum([len(t) for t in tokens])])[:-1]
        return {
            "text_offset": offsets.tolist() if self.strings.decodes else [0] * len(tokens),
            "token_logprobs": lps,
            "tokens": tokens,
            "top_logprobs": tops,
        }

    def _prompt_logprobs(self, prompt: list[int], start: int) -> list:
        k = self.body.prompt_logprobs
        out: list = [None]
        for t in range(1, len(prompt)):
            row = start + t
            if self.skip[row]:
                out.append(None)
                continue
            entry = {
                str(prompt[t]): {
                    "logprob": self.logprobs[row],
                    "rank": self.ranks[row],
                    "decoded_token": self.strings(prompt[t]),
                }
            }
            ids, lps = self.top_ids[row][:k], self.top_lps[row][:k]
            for j, (token, lp) in enumerate(zip(ids, lps, strict=True)):
                entry[str(token)] = {
                    "logprob": lp,
                    "rank": j + 1,
                    "decoded_token": self.strings(token),
                }
            out.append(entry)
        return out

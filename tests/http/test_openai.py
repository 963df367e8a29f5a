"""The official ``openai`` client, unchanged, against ``megascore serve --http-port``:
``completions.create(echo=True, logprobs=5, max_tokens=0)`` with token-id prompts and text
prompts equals transformers (<= 1e-4)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.http.checkpoint import VOCAB

pytest.importorskip("openai")
TOL = 1e-4
K = 5
TEXTS = [
    "the cat eats an apple near the river.",
    "Question: how many legs has a dog? Answer: four, 1234!",
]


@pytest.fixture
def client(llama):
    import openai

    with openai.OpenAI(base_url=f"{llama.base_url}/v1", api_key="x", max_retries=0) as c:
        yield c


def _check_choice(choice, ids, ref) -> float:
    """One echoed choice against transformers; returns the max |delta|."""
    logprobs = choice.logprobs
    assert choice.finish_reason in ("length", "stop"), choice.finish_reason
    assert len(logprobs.token_logprobs) == len(ids), (len(logprobs.token_logprobs), len(ids))
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    rows = ref.logprobs(ids)
    strings = [ref.tokenizer.decode([i]) for i in ids]
    assert logprobs.tokens == strings
    assert logprobs.text_offset == np.cumsum([0, *map(len, strings[:-1])]).tolist()
    worst = 0.0
    for t in range(1, len(ids)):
        row = rows[t - 1]
        worst = max(worst, abs(logprobs.token_logprobs[t] - row[ids[t]]))
        top = logprobs.top_logprobs[t]
        # As vLLM: the actual token and the top K, keyed by token string. Ids that decode
        # alike (lone bytes of UTF-8 characters) share a key, so each value is the
        # reference logprob of one of the ids with that string.
        candidates: dict[str, list[float]] = {}
        for i in [ids[t], *np.argsort(-row)[:K]]:
            candidates.setdefault(ref.tokenizer.decode([int(i)]), []).append(row[i])
        assert top.keys() == candidates.keys(), (t, top, candidates)
        for key, value in top.items():
            worst = max(worst, min(abs(value - c) for c in candidates[key]))
    assert worst <= TOL, worst
    return worst


def test_token_id_prompts(client, llama, references):
    ref = references["llama"]
    rng = np.random.default_rng(3)
    prompts = [ref.encode(TEXTS[0]), rng.integers(0, VOCAB, 17).tolist()]
    worst = 0.0
    for prompt in ([prompts[0]], prompts):  # one prompt; a batch (one choice each, in order)
        out = client.completions.create(
            model=llama.model_id(),
            prompt=prompt[0] if len(prompt) == 1 else prompt,
            echo=True,
            logprobs=K,
            max_tokens=0,
        )
        assert [c.index for c in out.choices] == list(range(len(prompt)))
        for choice, ids in zip(out.choices, prompt, strict=True):
            worst = max(worst, _check_choice(choice, ids, ref))
        assert out.usage.prompt_tokens == sum(map(len, prompt))
        assert out.usage.completion_tokens == 0
    print(f"openai completions (ids) vs transformers: max |delta| {worst:.3g}")


def test_text_prompts(client, llama, references):
    ref = references["llama"]
    worst = 0.0
    for prompt in (TEXTS[0], TEXTS):
        out = client.completions.create(
            model=llama.model_id(), prompt=prompt, echo=True, logprobs=K, max_tokens=0
        )
        texts = [prompt] if isinstance(prompt, str) else prompt
        assert len(out.choices) == len(texts)
        for choice, text in zip(out.choices, texts, strict=True):
            assert choice.text == text  # echo, nothing generated
            worst = max(worst, _check_choice(choice, ref.encode(text), ref))
    print(f"openai completions (text) vs transformers: max |delta| {worst:.3g}")

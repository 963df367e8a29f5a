"""SGLang's ``POST /generate`` as slime's on-policy distillation sends it and reads it,
against ``megascore serve --http-port``, equal to transformers.

slime (THUDM/slime, slime/rollout/on_policy_distillation.py, ``reward_func`` and
``post_process_rewards``) posts ``{"input_ids": sample.tokens, "sampling_params":
{"temperature", "max_new_tokens": 0, "skip_special_tokens": False}, "return_logprob": true,
"logprob_start_len": 0}`` to the teacher and keeps ``[item[0] for item in
meta_info["input_token_logprobs"][1:]]`` (float32), the last ``response_length`` of them.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.http.checkpoint import VOCAB

pytest.importorskip("requests")
TOL = 1e-4


def slime_payload(tokens: list[int], temperature: float = 1.0) -> dict:
    """slime's ``reward_func`` body (no images)."""
    return {
        "input_ids": tokens,
        "sampling_params": {
            "temperature": temperature,
            "max_new_tokens": 0,
            "skip_special_tokens": False,
        },
        "return_logprob": True,
        "logprob_start_len": 0,
    }


def slime_teacher_log_probs(reward: dict, response_length: int) -> np.ndarray:
    """slime's ``post_process_rewards`` on one answer."""
    import torch

    t = torch.tensor(
        [item[0] for item in reward["meta_info"]["input_token_logprobs"][1:]], dtype=torch.float32
    )
    return t[-response_length:].numpy()


def test_slime_teacher_logprobs_equal_transformers(llama, references):
    ref = references["llama"]
    rng = np.random.default_rng(11)
    samples = [
        (ref.encode("Question: what colour is the sky? Answer: blue."), 4),
        (rng.integers(0, VOCAB, 30).tolist(), 12),
    ]
    worst = 0.0
    for tokens, response_length in samples:
        reward = llama.post("/generate", slime_payload(tokens))
        meta = reward["meta_info"]
        entries = meta["input_token_logprobs"]
        assert len(entries) == len(tokens)
        assert entries[0][0] is None and entries[0][1] == tokens[0]
        assert [e[1] for e in entries] == tokens
        assert meta["prompt_tokens"] == len(tokens)
        got = slime_teacher_log_probs(reward, response_length)
        want = ref.token_logprobs(tokens)[-response_length:]
        assert got.shape == want.shape
        worst = max(worst, float(np.abs(got - want).max()))
        # all positions too, not only the response
        full = np.array([e[0] for e in entries[1:]])
        worst = max(worst, float(np.abs(full - ref.token_logprobs(tokens)).max()))
    assert worst <= TOL, worst
    print(f"slime /generate vs transformers: max |delta| {worst:.3g}")


def test_generate_batch_top_and_chosen_ids(llama, references):
    """The other SGLang input-logprob fields: a batch of ``input_ids``,
    ``top_logprobs_num`` -> ``input_top_logprobs``, ``token_ids_logprob`` ->
    ``input_token_ids_logprobs``, ``return_text_in_logprobs``, ``logprob_start_len`` > 0,
    and a ``text`` prompt."""
    ref = references["llama"]
    rows = [ref.encode("the old man paints a red house."), list(range(100, 111))]
    chosen = [3, 50, 300]
    body = {
        "input_ids": rows,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 2,
        "top_logprobs_num": 4,
        "token_ids_logprob": chosen,
        "return_text_in_logprobs": True,
    }
    answers = llama.post("/generate", body)
    assert isinstance(answers, list) and len(answers) == len(rows)
    worst = 0.0
    for answer, ids in zip(answers, rows, strict=True):
        meta = answer["meta_info"]
        lp = ref.logprobs(ids)
        token_lps, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
        chosen_lps = meta["input_token_ids_logprobs"]
        assert len(token_lps) == len(tops) == len(chosen_lps) == len(ids) - 2
        for j, t in enumerate(range(2, len(ids))):
            value, token, text = token_lps[j]
            assert token == ids[t] and text == ref.tokenizer.decode([ids[t]])
            if j == 0 and value is None:
                # SGLang (>= 0.4.6) pads the first returned position with None whatever
                # logprob_start_len is; older versions and vLLM give its value.
                assert tops[j] is None and chosen_lps[j] is None, (tops[j], chosen_lps[j])
                continue
            worst = max(worst, abs(value - lp[t - 1, ids[t]]))
            expected = np.sort(lp[t - 1])[::-1][:4]
            assert len(tops[j]) == 4
            worst = max(worst, np.abs(np.array([e[0] for e in tops[j]]) - expected).max())
            for v, i, s in tops[j]:
                worst = max(worst, abs(v - lp[t - 1, i]))
                assert s == ref.tokenizer.decode([i])
            assert [e[1] for e in chosen_lps[j]] == chosen
            worst = max(worst, max(abs(v - lp[t - 1, i]) for v, i, _ in chosen_lps[j]))
    assert worst <= TOL, worst

    text = "the old man paints a red house."
    answer = llama.post(
        "/generate",
        {
            "text": text,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    ids = ref.encode(text)
    entries = answer["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids
    got = np.array([e[0] for e in entries[1:]])
    assert np.abs(got - ref.token_logprobs(ids)).max() <= TOL

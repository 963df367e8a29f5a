"""TRL's ``VLLMClient.get_sequence_logprobs`` (its server-distillation trainer's teacher
call), unchanged, against ``megascore serve --http-port``, equal to transformers.

The client is built exactly as ``trl.experimental.server_distillation`` builds it
(``VLLMClient(base_url=..., connection_timeout=60.0)``: GET /health, GET /v1/models), then
``get_sequence_logprobs`` POSTs /v1/completions with ``prompt_logprobs: k`` and
``max_tokens: 1`` and reads ``choices[i].prompt_logprobs``. One thing is patched: the
constructor refuses to run unless the ``vllm`` package is installed (``is_vllm_available()``,
trl/generation/vllm_client.py), though nothing it or ``get_sequence_logprobs`` does uses
vLLM (vLLM is only needed for ``init_communicator`` / weight sync, which a teacher never
calls). The test makes that check answer True for the constructor and touches nothing else.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.http.checkpoint import VOCAB

pytest.importorskip("trl")
TOL = 1e-4
TOP = 8


def _sequences(reference):
    """Prompt + completion token ids: a text and a random-id row (rare tokens included)."""
    text = reference.encode("the teacher explains a small boat near the river on monday.")
    rng = np.random.default_rng(7)
    return [text, rng.integers(0, VOCAB, 23).tolist(), text[:5]], [6, 10, 2]


@pytest.fixture
def vllm_client(llama, monkeypatch):
    from trl.generation import vllm_client

    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *a, **k: True)
    client = vllm_client.VLLMClient(base_url=llama.base_url, connection_timeout=60.0)
    assert client.model == llama.model_id()
    return client


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_get_sequence_logprobs_equals_transformers(vllm_client, references, temperature):
    """Also at the distillation temperature: the teacher's log-softmax of logits / T."""
    ref = references["llama"]
    sequences, prompt_lengths = _sequences(ref)
    out = vllm_client.get_sequence_logprobs(
        sequences, prompt_lengths, top_logprobs=TOP, temperature=temperature
    )
    worst = 0.0
    for i, (seq, start) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        scaled = ref.logprobs(seq) / temperature  # [L, V]: row t-1 predicts seq[t]
        rows = scaled - np.logaddexp.reduce(scaled, axis=-1, keepdims=True)
        n = len(seq) - start
        for key in ("logprobs", "logprob_token_ids", "actual_logprobs", "actual_token_ids"):
            assert len(out[key][i]) == n, (key, i, len(out[key][i]), n)
        for j, t in enumerate(range(start, len(seq))):
            row = rows[t - 1]
            values = np.array(out["logprobs"][i][j])
            ids = np.array(out["logprob_token_ids"][i][j])
            assert len(values) == TOP and np.all(np.isfinite(values)), (i, t, values)
            assert np.all(np.diff(values) <= 0), (i, t, values)  # sorted by rank
            expected = np.sort(row)[::-1][:TOP]
            worst = max(worst, np.abs(values - expected).max(), np.abs(row[ids] - values).max())
            actual = out["actual_logprobs"][i][j][0]
            assert out["actual_token_ids"][i][j] == [seq[t]]
            assert math.isfinite(actual), (i, t)  # vLLM adds the actual token beside the top-k
            worst = max(worst, abs(actual - row[seq[t]]))
    assert worst <= TOL, worst
    print(f"TRL get_sequence_logprobs (T={temperature}) vs transformers: max |delta| {worst:.3g}")


def test_prompt_logprobs_shape_and_ranks(llama, references):
    """The raw answer TRL reads: ``prompt_logprobs[t]`` is None at t = 0, else
    ``{"<id>": {"logprob", "rank", "decoded_token"}}`` with the top k plus the actual
    token, ranks as vLLM counts them (1 + the number of tokens more likely)."""
    ref = references["llama"]
    seq = _sequences(ref)[0][1]
    body = {"model": llama.model_id(), "prompt": [seq], "max_tokens": 1, "prompt_logprobs": 3}
    choice = llama.post("/v1/completions", body)["choices"][0]
    prompt_logprobs = choice["prompt_logprobs"]
    assert len(prompt_logprobs) == len(seq) and prompt_logprobs[0] is None
    rows = ref.logprobs(seq)
    for t in range(1, len(seq)):
        entry, row = prompt_logprobs[t], rows[t - 1]
        assert str(seq[t]) in entry and len(entry) in (3, 4), (t, entry)
        order = np.argsort(-row)
        for token, item in entry.items():
            token = int(token)
            assert set(item) >= {"logprob", "rank", "decoded_token"}, item
            assert abs(item["logprob"] - row[token]) <= TOL, (t, token, item, row[token])
            close = np.abs(row - row[token]) <= 1e-5  # ties: either rank
            rank = 1 + int(np.sum(row > row[token]))
            assert rank <= item["rank"] <= rank + int(close.sum()) - 1, (t, token, item, rank)
            assert item["decoded_token"] == ref.tokenizer.decode([token]), (token, item)
        assert {int(k) for k, v in entry.items() if v["rank"] <= 3} == set(order[:3].tolist())

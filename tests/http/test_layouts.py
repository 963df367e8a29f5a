"""Every HTTP endpoint at TP=2 and PP=2 answers as the one-rank server does (<= 1e-5), and
on a MoE checkpoint as transformers does (<= 1e-4), with the routing and MoE metrics of
the ``megascore`` extras key equal to what the same server returns over gRPC."""

from __future__ import annotations

import numpy as np
import pytest

from tests.http.checkpoint import VOCAB

TOL_LAYOUT = 1e-5
TOL_REF = 1e-4
TEXT = "a young pilot builds a small boat near the river."
VOLATILE = {"id", "created", "timings", "weights_version"}
"""Answer fields that differ between two servers or two calls (request ids, clocks)."""


def _rows(ref) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [ref.encode(TEXT), rng.integers(0, VOCAB, 19).tolist()]


def probe(server, rows: list[list[int]]) -> dict:
    """One call to every endpoint (scoring ones with ids and text prompts)."""
    model = server.model_id()
    scoring = {"sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    answers = {path: server.get(path) for path in ("/health", "/health_generate", "/ping")}
    answers["/v1/models"] = server.get("/v1/models")
    answers["/tokenizer_info"] = server.get("/tokenizer_info")
    answers["/tokenize"] = server.post("/tokenize", {"prompt": TEXT, "add_special_tokens": False})
    answers["/detokenize"] = server.post("/detokenize", {"tokens": rows[0]})
    echo = {"model": model, "echo": True, "logprobs": 3, "max_tokens": 1, "temperature": 0}
    answers["completions echo"] = server.post("/v1/completions", {**echo, "prompt": rows})
    answers["completions text"] = server.post(
        "/v1/completions", {**echo, "prompt": TEXT, "max_tokens": 0}
    )
    answers["completions prompt_logprobs"] = server.post(
        "/v1/completions",
        {"model": model, "prompt": rows, "max_tokens": 1, "prompt_logprobs": 4},
    )
    answers["generate ids"] = server.post(
        "/generate",
        {
            **scoring,
            "input_ids": rows,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
            "token_ids_logprob": [1, 7],
            "return_text_in_logprobs": True,
        },
    )
    answers["generate text"] = server.post(
        "/generate", {**scoring, "text": TEXT, "logprob_start_len": 0}
    )
    return answers


def assert_close(got, want, tol: float, path: str = "") -> float:
    """Same structure and values; floats within ``tol`` (returns the max |delta|)."""
    if isinstance(want, dict):
        assert isinstance(got, dict), (path, got)
        keys = want.keys() - VOLATILE
        assert got.keys() - VOLATILE == keys, (path, sorted(got), sorted(want))
        return max((assert_close(got[k], want[k], tol, f"{path}.{k}") for k in keys), default=0)
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (path, got, want)
        pairs = enumerate(zip(got, want, strict=True))
        return max((assert_close(g, w, tol, f"{path}[{i}]") for i, (g, w) in pairs), default=0.0)
    if isinstance(want, float) and not isinstance(got, bool):
        assert isinstance(got, (int, float)), (path, got, want)
        assert abs(got - want) <= tol, (path, got, want)
        return abs(got - want)
    assert got == want, (path, got, want)
    return 0.0


@pytest.fixture(scope="session")
def one_rank_answers(http_pool, references):
    return probe(http_pool("llama"), _rows(references["llama"]))


@pytest.mark.parametrize("server_name", ["llama-tp2", "llama-pp2"])
def test_layout_equals_one_rank(server_name, http_pool, one_rank_answers, references):
    server = http_pool(server_name)
    got = probe(server, _rows(references["llama"]))
    delta = assert_close(got, one_rank_answers, TOL_LAYOUT)
    print(f"{server_name} vs one rank, every endpoint: max |delta| {delta:.3g}")


def _check_scoring(answers: dict, rows, ref) -> float:
    """The scoring answers of :func:`probe` against ``transformers``."""
    worst = 0.0
    for i, ids in enumerate(rows):
        want = ref.token_logprobs(ids)
        lps = answers["completions echo"]["choices"][i]["logprobs"]["token_logprobs"]
        assert len(lps) == len(ids) + 1 and lps[0] is None  # + the greedy next token
        worst = max(worst, np.abs(np.array(lps[1:-1]) - want).max())
        greedy = answers["completions echo"]["choices"][i]["logprobs"]["top_logprobs"][-1]
        worst = max(worst, abs(max(greedy.values()) - ref.logprobs(ids)[-1].max()))
        prompt_lps = answers["completions prompt_logprobs"]["choices"][i]["prompt_logprobs"]
        got = [prompt_lps[t][str(ids[t])]["logprob"] for t in range(1, len(ids))]
        worst = max(worst, np.abs(np.array(got) - want).max())
        entries = answers["generate ids"][i]["meta_info"]["input_token_logprobs"]
        worst = max(worst, np.abs(np.array([e[0] for e in entries[1:]]) - want).max())
    assert worst <= TOL_REF, worst
    return worst


def test_one_rank_equals_transformers(one_rank_answers, references):
    ref = references["llama"]
    delta = _check_scoring(one_rank_answers, _rows(ref), ref)
    print(f"llama one rank, every scoring endpoint vs transformers: max |delta| {delta:.3g}")


@pytest.mark.parametrize("server_name", ["moe"])
def test_moe_equals_transformers(server_name, http_pool, references):
    ref = references["qwen3_moe"]
    rows = _rows(ref)
    delta = _check_scoring(probe(http_pool(server_name), rows), rows, ref)
    print(f"MoE, every scoring endpoint vs transformers: max |delta| {delta:.3g}")


@pytest.mark.parametrize("server_name", ["moe"])
def test_moe_routing_and_metrics_through_extras(server_name, http_pool, references):
    """``"megascore": {"return_routing", "return_moe_metrics"}`` on /v1/completions and
    /generate equals the gRPC SDK's answer from the same server for the same batch."""
    from megascore_client import ScoringClient

    server = http_pool(server_name)
    rows = _rows(references["qwen3_moe"])
    extras = {"return_routing": True, "return_moe_metrics": True}
    completion = server.post(
        "/v1/completions",
        {"model": server.model_id(), "prompt": rows, "max_tokens": 0, "megascore": extras},
    )
    generated = server.post(
        "/generate",
        {"input_ids": rows, "sampling_params": {"max_new_tokens": 0}, "megascore": extras},
    )
    with ScoringClient(server.target) as client:
        want = client.score(rows, return_routing=True, metrics=("moe",))
    assert want.moe_metrics and want.routing is not None
    metrics = completion["megascore"]["moe_metrics"]
    assert metrics.keys() == want.moe_metrics.keys()
    for name, value in want.moe_metrics.items():
        assert abs(metrics[name] - value) <= 1e-6 * max(1.0, abs(value)), (name, metrics, want)
    for i, ids in enumerate(rows):
        routes = [
            np.asarray(completion["choices"][i]["megascore"]["routing"]),
            np.asarray(generated[i]["meta_info"]["megascore"]["routing"]),
        ]
        for got in routes:
            assert got.shape == want.routing[i].shape == (len(ids), *want.routing[i].shape[1:])
            np.testing.assert_array_equal(got, want.routing[i])
        lps = completion["choices"][i]["megascore"]["logprobs"]
        np.testing.assert_allclose(lps, want.logprobs[i], atol=1e-6)

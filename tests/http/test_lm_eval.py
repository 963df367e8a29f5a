"""lm-evaluation-harness, unchanged, against ``megascore serve --http-port``.

Its ``local-completions`` model (POST /v1/completions with ``echo``, ``logprobs: 1``,
``max_tokens: 1``; loglikelihood and loglikelihood_rolling) on a local multiple-choice
task and a rolling task equals lm-eval's own ``hf`` model on the same checkpoint: every
choice's loglikelihood within 1e-4, ``is_greedy`` and ``acc`` equal. With
``tokenizer_backend=auto`` lm-eval finds the server's /tokenizer_info and /tokenize and
tokenizes through them (its "remote" backend): the same results.
"""

from __future__ import annotations

import pytest

from tests.http.lm_eval_tasks import MC_TASK, ROLLING_TASK, evaluate, greedy_doc, write_tasks

pytest.importorskip("lm_eval")
TOL = 1e-4


@pytest.fixture(scope="session")
def lm_tasks(tmp_path_factory, references):
    """The task folder (the six questions plus one with greedy choices)."""
    return write_tasks(tmp_path_factory.mktemp("lm-eval-tasks"), [greedy_doc(references["llama"])])


@pytest.fixture(scope="session")
def hf_results(lm_tasks, checkpoints):
    """lm-eval's ``hf`` model on the llama checkpoint (float32, CPU)."""
    results = evaluate(lm_tasks, "hf", f"pretrained={checkpoints['llama']},dtype=float32", 4)
    greedy = [r[1] for docs in results[MC_TASK]["docs"].values() for r in docs]
    assert any(greedy) and not all(greedy), greedy  # both outcomes are exercised
    return results


def _compare(got: dict, expected: dict) -> float:
    """Asserts per-choice / per-document equality; returns the max |loglikelihood delta|."""
    worst = 0.0
    for task in (MC_TASK, ROLLING_TASK):
        assert got[task]["docs"].keys() == expected[task]["docs"].keys()
        for doc_id, want in expected[task]["docs"].items():
            have = got[task]["docs"][doc_id]
            assert len(have) == len(want), (task, doc_id, have, want)
            for h, w in zip(have, want, strict=True):
                if task == MC_TASK:
                    assert h[1] == w[1], (task, doc_id, "is_greedy", have, want)
                    h, w = h[0], w[0]
                worst = max(worst, abs(h - w))
                assert abs(h - w) <= TOL, (task, doc_id, have, want)
    assert got[MC_TASK]["metrics"]["acc,none"] == expected[MC_TASK]["metrics"]["acc,none"]
    return worst


def _model_args(server, **extra) -> str:
    args = {
        "base_url": f"{server.base_url}/v1/completions",
        "model": server.model_id(),
        "max_length": 512,
        "max_retries": 1,
        **extra,
    }
    return ",".join(f"{k}={v}" for k, v in args.items())


def test_local_completions_equals_hf(llama, lm_tasks, hf_results, checkpoints):
    """Tokenized requests with the checkpoint's tokenizer; four prompts per request, two
    requests at a time (lm-eval's aiohttp path)."""
    args = _model_args(
        llama,
        tokenizer=checkpoints["llama"],
        tokenizer_backend="huggingface",
        tokenized_requests=True,
        num_concurrent=2,
    )
    got = evaluate(lm_tasks, "local-completions", args, batch_size=4)
    delta = _compare(got, hf_results)
    print(f"lm-eval local-completions vs hf: max |delta| {delta:.3g}")


def test_remote_tokenizer_equals_hf(llama, lm_tasks, hf_results):
    """``tokenizer_backend=auto`` probes /tokenizer_info and /tokenize, then tokenizes on
    the server (/tokenize) and sends one prompt per request."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.utils import check_remote_tokenizer_support

    base_url = f"{llama.base_url}/v1/completions"
    assert check_remote_tokenizer_support(base_url)
    args = _model_args(llama, tokenizer_backend="auto", tokenized_requests=True)
    lm = LocalCompletionsAPI.create_from_arg_string(args, {"batch_size": 1})
    assert lm.tokenizer_backend == "remote"
    assert lm.tokenizer.eos_token == "<|endoftext|>"
    assert lm.eot_token_id == 0 and lm.prefix_token_id == 0
    got = evaluate(lm_tasks, lm, None)
    delta = _compare(got, hf_results)
    print(f"lm-eval remote tokenizer vs hf: max |delta| {delta:.3g}")

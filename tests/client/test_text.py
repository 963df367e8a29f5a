"""Text in, text out through the server's tokenizer: ``tokenize`` / ``detokenize`` /
``score_text`` of both clients against a fake Scorer whose tokenizer the test also
calls directly (the reference)."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from megascore_client import AsyncScoringClient, InvalidInputError, ScoringClient, ScoringError
from tests.client.fake_server import FakeServer, ref_logprobs
from tests.client.text_server import BOS, TextScorer, word_tokenizer

TEXTS = ["t5 t9 t300", "t7", ""]


@pytest.fixture
def text_server():
    with FakeServer(TextScorer()) as srv:
        yield srv


def test_tokenize_matches_the_tokenizer(text_server):
    tok = word_tokenizer()
    with ScoringClient(text_server.target, timeout=10) as client:
        ids = client.tokenize(TEXTS)
        plain = client.tokenize(TEXTS, add_special_tokens=False)
    assert [r.dtype for r in ids] == [np.int64] * 3
    assert [r.tolist() for r in ids] == [tok.encode(t).ids for t in TEXTS]
    assert ids[0].tolist() == [BOS, 5, 9, 300]
    assert [r.tolist() for r in plain] == [[5, 9, 300], [7], []]


def test_detokenize_gives_texts_and_one_string_per_id(text_server):
    with ScoringClient(text_server.target, timeout=10) as client:
        out = client.detokenize([[1, 5, 9], np.array([300]), []])
        skipped = client.detokenize([[1, 5, 9]], skip_special_tokens=True)
    assert out.tokens == [["t1", "t5", "t9"], ["t300"], []]
    assert out.texts == ["t1 t5 t9", "t300", ""]
    assert skipped.texts == ["t5 t9"]


def test_score_text_scores_the_tokenized_texts(text_server):
    with ScoringClient(text_server.target, timeout=10) as client:
        out = client.score_text(TEXTS[:2], top_k=2, return_tokens=True)
        calls = dict(text_server.scorer.calls)
    assert [r.tolist() for r in out.token_ids] == [[1, 5, 9, 300], [1, 7]]
    assert out.tokens == [["t1", "t5", "t9", "t300"], ["t1", "t7"]]
    for i, ids in enumerate(out.token_ids):
        np.testing.assert_array_equal(out.logprobs[i], ref_logprobs(ids))  # reads through
        assert out.result.logprobs[i] is out.logprobs[i]
    assert out.top_k_ids[0].shape == (4, 2)
    assert calls["Tokenize"] == 1 and calls["Detokenize"] == 1


def test_a_text_without_tokens_and_a_bare_string_are_refused(text_server):
    with ScoringClient(text_server.target, timeout=10) as client:
        with pytest.raises(InvalidInputError, match=r"texts\[1\] gives no token"):
            client.score_text(["t5", ""], add_special_tokens=False)
        with pytest.raises(InvalidInputError, match="wrap a single text in a list"):
            client.tokenize("t5 t6")
        with pytest.raises(InvalidInputError, match=r"texts\[0\] is int"):
            client.tokenize([5])
        with pytest.raises(InvalidInputError, match=r"ids\[1\] must be a 1-D"):
            client.detokenize([[1], [[2]]])


def test_a_server_without_a_tokenizer_answers_failed_precondition():
    with FakeServer(TextScorer(has_tokenizer=False)) as srv:
        with ScoringClient(srv.target, timeout=10) as client:
            assert client.model_info().has_tokenizer is False
            with pytest.raises(ScoringError) as err:
                client.score_text(["t5 t6"])
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "no tokenizer" in err.value.details


def test_the_async_client_has_the_same_methods(text_server):
    async def main():
        async with AsyncScoringClient(text_server.target, timeout=10) as client:
            ids = await client.tokenize(TEXTS[:1])
            back = await client.detokenize(ids)
            scored = await client.score_text(TEXTS[:1], return_tokens=True)
        return ids, back, scored

    ids, back, scored = asyncio.run(main())
    assert ids[0].tolist() == [1, 5, 9, 300]
    assert back.tokens == [["t1", "t5", "t9", "t300"]] and back.texts == ["t1 t5 t9 t300"]
    np.testing.assert_array_equal(scored.logprobs[0], ref_logprobs([1, 5, 9, 300]))
    assert scored.tokens == back.tokens

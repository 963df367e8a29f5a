"""Trainer-shaped adapters: NeMo-RL ``score_padded`` and verl ``score_responses``.

The fake server's logprobs are made to depend on the previous token and the position
(a real model's do), so a pad token sent, a shifted row or a misplaced value changes
them. Every padded result is checked against the client scoring the unpadded
sequences directly, placed by hand where each layout says.
"""

from __future__ import annotations

import asyncio
import inspect
import pydoc

import numpy as np
import pytest

from megascore.v1 import scoring_pb2 as pb
from megascore_client import AsyncScoringClient, InvalidInputError, ScoringClient
from tests.client import fake_server

PAD = 7  # a pad id that is a real token: sending it would change the answers


def context_logprobs(ids, temperature: float = 1.0) -> np.ndarray:
    """float32 [L]: entry 0 is 0.0, entry t depends on x_t, x_{t-1} and t."""
    ids = np.asarray(ids, dtype=np.int64)
    t = np.arange(len(ids))
    prev = np.concatenate([[0], ids[:-1]])
    out = (-(((3 * ids + 5 * prev + t) % 11) + 1) / 10.0 / temperature).astype(np.float32)
    out[0] = 0.0
    return out


@pytest.fixture(autouse=True)
def context_dependent_server(monkeypatch):
    monkeypatch.setattr(fake_server, "ref_logprobs", context_logprobs)


def _nemo_rl_batch():
    """Right-padded [5, 9]: full, short, one-token and empty rows."""
    rng = np.random.default_rng(0)
    lengths = np.array([9, 4, 1, 0, 6])
    ids = np.full((5, 9), PAD, dtype=np.int64)
    seqs = []
    for b, n in enumerate(lengths):
        seq = rng.integers(0, fake_server.VOCAB, n)
        ids[b, :n] = seq
        seqs.append(seq)
    return ids, lengths, seqs


def _verl_batch():
    """Left-padded prompts [4, 5] + right-padded responses [4, 4]: a full row, an empty
    response, an empty prompt, a short prompt with a one-token response."""
    rng = np.random.default_rng(1)
    prompt_lens, response_lens = [5, 3, 0, 2], [4, 0, 3, 1]
    prompts = np.full((4, 5), PAD, dtype=np.int64)
    responses = np.full((4, 4), PAD, dtype=np.int64)
    mask = np.zeros((4, 9), dtype=np.int64)
    parts = []
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        prompt = rng.integers(0, fake_server.VOCAB, p)
        response = rng.integers(0, fake_server.VOCAB, r)
        prompts[b, 5 - p :] = prompt
        responses[b, :r] = response
        mask[b, 5 - p : 5 + r] = 1
        parts.append((prompt, response))
    return np.concatenate([prompts, responses], axis=1), mask, responses, parts


def test_score_padded_is_the_nemo_rl_layout(client, server):
    ids, lengths, seqs = _nemo_rl_batch()
    got = client.score_padded(ids, lengths, temperature=0.5)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (5, 9)
    nonempty = [s for s in seqs if len(s)]
    direct = client.score(nonempty, temperature=0.5).logprobs
    expected = np.zeros((5, 9), dtype=np.float32)
    for b, row in zip([0, 1, 2, 4], direct, strict=True):
        expected[b, : len(row)] = row
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(expected[1, :4], context_logprobs(seqs[1], 0.5))
    assert (got[:, 0] == 0).all() and (got[1, 4:] == 0).all() and (got[3] == 0).all()
    # Only the real tokens travel; the empty row is not sent.
    first_call = server.scorer.requests[-2]
    assert first_call["num_sequences"] == 4 and first_call["num_tokens"] == lengths.sum()


def test_score_responses_is_the_verl_layout(client, server):
    input_ids, mask, responses, parts = _verl_batch()
    got = client.score_responses(input_ids, mask, responses)
    assert got.dtype == np.float32 and got.shape == (4, 4)
    direct = client.score([np.concatenate(p) for p in parts])
    expected = np.zeros((4, 4), dtype=np.float32)
    for b, ((prompt, response), row) in enumerate(zip(parts, direct.logprobs, strict=True)):
        expected[b, : len(response)] = row[len(prompt) :]
    np.testing.assert_array_equal(got, expected)
    assert (got[1] == 0).all()  # empty response
    assert got[2, 0] == 0.0 and got[2, 1] != 0.0  # no prompt: the first token has no logprob
    # verl's own slicing of a full row's logprobs: [:, -R-1:-1] of the shifted values.
    full = context_logprobs(input_ids[0])
    np.testing.assert_array_equal(got[0], np.roll(full, -1)[-5:-1])
    # Masked by verl's response_mask, the result is what the trainer uses.
    assert ((got != 0) <= (mask[:, -4:] == 1)).all()
    # Rows with a response are sent, their real tokens only (row 1 has no response).
    sent = server.scorer.requests[-2]
    assert sent["num_sequences"] == 3 and sent["num_tokens"] == mask[[0, 2, 3]].sum()
    # ... asking for the logprobs at the response tokens only (a server that computes
    # every row, as this fake does, gives the same answer)
    assert sent["options"].logprob_positions == pb.LOGPROB_POSITIONS_MASKED
    in_response = np.zeros_like(mask)
    in_response[:, -4:] = 1
    np.testing.assert_array_equal(sent["loss_mask"], in_response[[0, 2, 3]][mask[[0, 2, 3]] == 1])


def test_torch_in_torch_out(client):
    torch = pytest.importorskip("torch")  # a dev dependency: present in CI
    ids, lengths, _ = _nemo_rl_batch()
    got = client.score_padded(torch.from_numpy(ids), torch.from_numpy(lengths))
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
    assert got.device == torch.device("cpu") and tuple(got.shape) == (5, 9)
    np.testing.assert_array_equal(got.numpy(), client.score_padded(ids, lengths))
    input_ids, mask, responses, _ = _verl_batch()
    verl = client.score_responses(
        torch.from_numpy(input_ids), torch.from_numpy(mask).bool(), torch.from_numpy(responses)
    )
    assert isinstance(verl, torch.Tensor) and tuple(verl.shape) == (4, 4)
    np.testing.assert_array_equal(verl.numpy(), client.score_responses(input_ids, mask, responses))


def test_async_adapters_match_the_sync_ones(client, server):
    ids, lengths, _ = _nemo_rl_batch()
    input_ids, mask, responses, _ = _verl_batch()

    async def run():
        async with AsyncScoringClient(server.target, timeout=10) as aclient:
            return (
                await aclient.score_padded(ids, lengths),
                await aclient.score_responses(input_ids, mask, responses, request_id="verl"),
            )

    padded, verl = asyncio.run(run())
    np.testing.assert_array_equal(padded, client.score_padded(ids, lengths))
    np.testing.assert_array_equal(verl, client.score_responses(input_ids, mask, responses))
    assert "verl" in [r["request_id"] for r in server.scorer.requests]


def test_all_empty_rows_send_nothing(client, server):
    got = client.score_padded(np.full((2, 3), PAD), [0, 0])
    np.testing.assert_array_equal(got, np.zeros((2, 3), np.float32))
    input_ids = np.full((2, 4), PAD)
    verl = client.score_responses(input_ids, np.zeros((2, 4), int), input_ids[:, 2:])
    np.testing.assert_array_equal(verl, np.zeros((2, 2), np.float32))
    assert server.scorer.calls["Score"] == 0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.score_padded([[1, 2], [3, 4]], [2, 3]), "input_lengths[1] = 3 is outside"),
        (lambda c: c.score_padded([[1, 2], [3, 4]], [2]), "input_lengths: 1 entries for 2 rows"),
        (lambda c: c.score_padded([1, 2], [2]), "input_ids: expected 2 dimensions"),
        (lambda c: c.score_padded([[1.5, 2]], [2]), "input_ids: expected integers"),
        (
            lambda c: c.score_responses([[1, 2, 3]], [[1, 1, 1]], [[2, 4]]),
            "responses[0] differs from input_ids[0, -R:]",
        ),
        (
            lambda c: c.score_responses([[1, 2, 3]], [[1, 2, 1]], [[2, 3]]),
            "attention_mask: values must be 0/1",
        ),
        (
            lambda c: c.score_responses([[1, 2, 3]], [[1, 1]], [[2, 3]]),
            "attention_mask: shape (1, 2) != input_ids (1, 3)",
        ),
    ],
)
def test_layout_errors_name_the_row(client, server, call, message):
    with pytest.raises(InvalidInputError) as info:
        call(client)
    assert message in info.value.details
    assert server.scorer.calls["Score"] == 0


def test_prompt_groups_are_runs_of_rows_sharing_a_prompt():
    """verl-shaped rows built by hand: 3 rollouts of prompt A (left padding of two
    widths around the same real tokens), 2 of B, one of A again, 2 of C of which one
    has an empty response (not scored, so not counted)."""
    from megascore_client.trainer_layouts import prompt_groups, verl_layout

    pad = 0
    a, b, c = [5, 6, 7], [5, 6, 8], [9]
    prompts = [a, a, a, b, b, a, c, c]
    responses = [
        [11, 12],
        [13, pad],
        [14, 15],
        [16, pad],
        [17, 18],
        [19, pad],
        [pad, pad],
        [20, 21],
    ]
    p_width = 4
    input_ids, mask = [], []
    for prompt, response in zip(prompts, responses, strict=True):
        left = p_width - len(prompt)
        input_ids.append([pad] * left + prompt + response)
        mask.append([0] * left + [1] * len(prompt) + [int(t != pad) for t in response])
    input_ids, mask = np.array(input_ids), np.array(mask)
    input_ids[1, 0] = 7  # a pad slot holding a token id (masked out: still prompt A)
    layout = verl_layout(input_ids, mask, input_ids[:, p_width:])
    np.testing.assert_array_equal(layout.rows, [0, 1, 2, 3, 4, 5, 7])
    np.testing.assert_array_equal(prompt_groups(layout), [3, 2, 1, 1])
    assert prompt_groups(verl_layout(input_ids[:0], mask[:0], input_ids[:0, p_width:])).size == 0


@pytest.mark.parametrize("method", ["score_padded", "score_responses"])
@pytest.mark.parametrize("cls", [ScoringClient, AsyncScoringClient])
def test_trainer_helpers_take_exactly_the_keywords_they_use(cls, method):
    """No ``**kwargs``: a keyword the helper would drop (``top_k``) or clash on
    (``losses``) is a TypeError naming it, at the call."""
    params = inspect.signature(getattr(cls, method)).parameters
    keywords = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keywords == [
        "temperature",
        "request_id",
        "timeout",
        "rollout_logprobs",
        "mismatch_ratio_cap",
        "weights_version",
    ]
    assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in params.values())
    assert all(params[k].annotation is not inspect.Parameter.empty for k in keywords)


def test_unknown_helper_keywords_are_refused(client):
    ids, lengths = np.array([[1, 2, 3]]), np.array([3])
    for bad in ({"top_k": 3}, {"losses": ("nll",)}):
        with pytest.raises(TypeError, match=next(iter(bad))):
            client.score_padded(ids, lengths, **bad)
    with pytest.raises(TypeError, match="top_k"):
        client.score_responses(ids, np.ones_like(ids), ids[:, 1:], top_k=3)


@pytest.mark.parametrize("cls", [ScoringClient, AsyncScoringClient])
def test_constructor_arguments_show_in_help(cls):
    params = inspect.signature(cls).parameters
    assert {"target", "tls", "token", "timeout", "wait_for_server_s", "max_request_tokens"} <= set(
        params
    )
    text = pydoc.render_doc(cls)
    assert "wait_for_server_s: 'float' = 0.0" in text and "ride out a server" in text


def test_group_sequences_put_each_continuation_after_its_prompt():
    from megascore_client.trainer_layouts import group_sequences

    seqs, masks = group_sequences([[1, 2], np.array([7])], [[[3], [4, 5], []], [[8, 9]]])
    assert [s.tolist() for s in seqs] == [[1, 2, 3], [1, 2, 4, 5], [1, 2], [7, 8, 9]]
    assert [m.tolist() for m in masks] == [[0, 0, 1], [0, 0, 1, 1], [0, 0], [0, 1, 1]]


@pytest.mark.parametrize(
    ("prompts", "continuations", "match"),
    [
        ([[1]], [[[2]], [[3]]], "2 groups for 1 prompts"),
        ([[1], [2]], [[[2]], []], r"continuations\[1\]: a group needs"),
        ([[1]], [[[2.5]]], r"continuations\[0\]\[0\]: expected integers"),
    ],
)
def test_group_sequences_name_the_bad_group(prompts, continuations, match):
    from megascore_client.trainer_layouts import group_sequences

    with pytest.raises(InvalidInputError, match=match):
        group_sequences(prompts, continuations)

"""Shared prompts through ``megascore serve`` (the shared ``--nproc 1`` server: prefix
sharing is on by default on the CPU): a batch of prefix groups scores like every
sequence scored alone (a step of one sequence shares nothing), and so do verl rows
that repeat a prompt n times. Groups on the wire (``ScoreRequest.groups``): the SDK
sends each shared prompt once, and the answer is bit for bit that of the request sent
whole. ``logprob_positions="masked"``: the dense values at the masked positions."""

from __future__ import annotations

import asyncio
import concurrent.futures

import numpy as np
import pytest

from megascore_client import AsyncScoringClient, ScoringClient
from megascore_client.inputs import make_batch
from megascore_client.splitting import ScoreOptions, build_parts
from tests.prefix_groups import prefix_group_sequences


def _spy_parts(client, monkeypatch) -> list:
    """The parts (requests) every later call of ``client`` sends, as it sends them."""
    sent = []
    prepare_call = client.prepare_call

    def spy(*args, **kwargs):
        parts, rid = prepare_call(*args, **kwargs)
        sent.extend(parts)
        return parts, rid

    monkeypatch.setattr(client, "prepare_call", spy)
    return sent


def test_groups_score_like_single_sequences(tp1):
    seqs, _ = prefix_group_sequences(21)
    with ScoringClient(tp1.target) as client:
        together = client.score(seqs, top_k=3)
        for i, seq in enumerate(seqs):
            alone = client.score([seq], top_k=3)
            np.testing.assert_allclose(together.logprobs[i], alone.logprobs[0], rtol=0, atol=1e-6)
            np.testing.assert_array_equal(together.top_k_ids[i], alone.top_k_ids[0])


def test_verl_rows_sharing_a_prompt(tp1, monkeypatch):
    rng = np.random.default_rng(5)
    n, prompt_len, width = 4, 24, 10
    prompt = rng.integers(1, 500, prompt_len)
    responses = rng.integers(1, 500, (n, width))
    input_ids = np.concatenate([np.tile(prompt, (n, 1)), responses], axis=1)
    mask = np.ones_like(input_ids)
    mask[1, prompt_len + 6 :] = 0  # a shorter response
    with ScoringClient(tp1.target) as client:
        sent = _spy_parts(client, monkeypatch)
        got = client.score_responses(input_ids, mask, responses)
        (part,) = sent  # the prompt went once (the rows share it and more)
        np.testing.assert_array_equal(np.frombuffer(part.request.groups.sizes.data, np.int64), [n])
        for b in range(n):
            real = input_ids[b, mask[b] == 1]
            alone = client.score([real]).logprobs[0][prompt_len:]
            np.testing.assert_allclose(got[b, : len(alone)], alone, rtol=0, atol=1e-6)


def test_a_group_split_over_concurrent_requests(tp1):
    """Two requests in flight with halves of the same groups (the batcher may merge them
    into one step, where they share): each scores like its sequences alone."""
    seqs, _ = prefix_group_sequences(22)
    halves = [seqs[0::2], seqs[1::2]]
    with ScoringClient(tp1.target) as client:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda half: client.score(half), halves))
        for half, result in zip(halves, results, strict=True):
            for seq, got in zip(half, result.logprobs, strict=True):
                alone = client.score([seq]).logprobs[0]
                np.testing.assert_allclose(got, alone, rtol=0, atol=1e-6)


def test_score_groups(tp1, monkeypatch):
    """The SDK's groups: per-continuation results equal to scoring each prompt +
    continuation alone; the NLL is the continuation's; the prompt went once."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(1, 500, n) for n in (30, 18)]
    continuations = [[rng.integers(1, 500, n) for n in (5, 1, 9)], [rng.integers(1, 500, 7)]]
    with ScoringClient(tp1.target) as client:
        sent = _spy_parts(client, monkeypatch)
        got = client.score_groups(prompts, continuations, top_k=2)
        (part,) = sent
        assert len(part.request.token_ids.data) == 4 * (30 + 5 + 1 + 9 + 18 + 7)  # int32 ids
        i = 0
        for prompt, conts in zip(prompts, continuations, strict=True):
            for cont in conts:
                alone = client.score([np.concatenate([prompt, cont])]).logprobs[0]
                np.testing.assert_allclose(got.logprobs[i], alone, rtol=0, atol=1e-6)
                want_nll = -float(alone[len(prompt) :].sum())
                assert got.loss["nll"][i] == pytest.approx(want_nll, rel=1e-5)
                i += 1
        assert i == len(got.logprobs) == 4


def test_groups_on_the_wire_answer_bit_for_bit_as_sent_whole(tp1):
    """The same request with and without groups (each alone on the server: the same
    engine step): identical responses; the grouped request is smaller."""
    rng = np.random.default_rng(12)
    seqs = []
    for prompt_len, n in ((120, 8), (40, 3), (17, 1)):
        prompt = rng.integers(1, 500, prompt_len)
        seqs += [np.r_[prompt, rng.integers(1, 500, rng.integers(0, 30))] for _ in range(n)]
    masks = [np.r_[np.zeros(20, np.uint8), np.ones(len(s) - 20, np.uint8)] for s in seqs]
    batch = make_batch(seqs, loss_mask=masks)
    options = ScoreOptions(top_k=3, losses=("nll",), return_entropy=True)
    grouped, whole = (
        build_parts(batch, options, "g", max_message_bytes=1 << 30, groups=groups)[0].request
        for groups in (True, False)
    )
    assert grouped.HasField("groups") and grouped.ByteSize() < 0.5 * whole.ByteSize()
    with ScoringClient(tp1.target) as client:
        got, want = (client.transport.stub.Score(r, timeout=120) for r in (grouped, whole))
    for response in (got, want):  # how long it took and where it came from: not the answer
        response.ClearField("timings")
        response.ClearField("cached_tokens")
    assert got == want


def test_async_score_groups_sends_the_prompt_once(tp1, monkeypatch):
    rng = np.random.default_rng(13)
    prompt = rng.integers(1, 500, 64)
    conts = [rng.integers(1, 500, n) for n in (3, 8, 5, 1)]

    async def run():
        async with AsyncScoringClient(tp1.target) as client:
            sent = _spy_parts(client, monkeypatch)
            result = await client.score_groups([prompt], [conts])
            return result, sent

    result, sent = asyncio.run(run())
    assert sent[0].request.HasField("groups") and len(sent[0].request.token_ids.data) == 4 * 81
    with ScoringClient(tp1.target) as client:
        for got, cont in zip(result.logprobs, conts, strict=True):
            alone = client.score([np.r_[prompt, cont]]).logprobs[0]
            np.testing.assert_allclose(got, alone, rtol=0, atol=1e-6)


def test_masked_positions_through_the_sdk(tp1):
    """``logprob_positions="masked"`` end to end: the dense values at the loss mask's
    positions, the fill elsewhere (losses unchanged)."""
    rng = np.random.default_rng(14)
    seqs = [rng.integers(1, 500, n) for n in (40, 25, 60)]
    masks = [(rng.random(len(s)) < 0.4).astype(np.uint8) for s in seqs]
    with ScoringClient(tp1.target) as client:
        dense = client.score(seqs, loss_mask=masks, top_k=2, return_entropy=True)
        got = client.score(
            seqs, loss_mask=masks, top_k=2, return_entropy=True, logprob_positions="masked"
        )
    for i, mask in enumerate(masks):
        inside = mask.astype(bool)
        inside[0] = False
        for name, fill in (("logprobs", 0.0), ("top_k_ids", -1), ("entropy", 0.0)):
            a, b = getattr(got, name)[i], getattr(dense, name)[i]
            np.testing.assert_allclose(a[inside], b[inside], rtol=0, atol=1e-6, err_msg=name)
            assert (a[~inside] == fill).all(), name
    np.testing.assert_allclose(got.loss["nll"], dense.loss["nll"], rtol=1e-6)


def test_a_request_over_one_step_keeps_its_groups_in_one_step(tp1):
    """GRPO groups whose dense tokens exceed the step budget (16384) but whose rows fit
    it: the batcher plans each group whole (issue 35), so the request takes one step and
    every sequence shares its prompt; each scores like itself alone."""
    rng = np.random.default_rng(35)
    seqs = []
    for _ in range(4):
        prompt = rng.integers(1, 500, 600).tolist()
        seqs += [prompt + rng.integers(1, 500, rng.integers(60, 140)).tolist() for _ in range(8)]
    assert sum(map(len, seqs)) > 16384
    with ScoringClient(tp1.target) as client:
        together = client.score(seqs)
        assert together.timings.num_steps == 1
        for i in rng.choice(len(seqs), 6, replace=False):
            alone = client.score([seqs[i]]).logprobs[0]
            np.testing.assert_allclose(together.logprobs[i], alone, rtol=0, atol=1e-6)

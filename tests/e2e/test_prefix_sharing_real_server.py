"""Shared prompts through ``megascore serve`` (the shared ``--nproc 1`` server: prefix
sharing is on by default on the CPU): a batch of prefix groups scores like every
sequence scored alone (a step of one sequence shares nothing), and so do verl rows
that repeat a prompt n times."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from megascore_client import ScoringClient
from tests.prefix_groups import prefix_group_sequences


def test_groups_score_like_single_sequences(tp1):
    seqs, _ = prefix_group_sequences(21)
    with ScoringClient(tp1.target) as client:
        together = client.score(seqs, top_k=3)
        for i, seq in enumerate(seqs):
            alone = client.score([seq], top_k=3)
            np.testing.assert_allclose(together.logprobs[i], alone.logprobs[0], rtol=0, atol=1e-6)
            np.testing.assert_array_equal(together.top_k_ids[i], alone.top_k_ids[0])


def test_verl_rows_sharing_a_prompt(tp1):
    rng = np.random.default_rng(5)
    n, prompt_len, width = 4, 24, 10
    prompt = rng.integers(1, 500, prompt_len)
    responses = rng.integers(1, 500, (n, width))
    input_ids = np.concatenate([np.tile(prompt, (n, 1)), responses], axis=1)
    mask = np.ones_like(input_ids)
    mask[1, prompt_len + 6 :] = 0  # a shorter response
    with ScoringClient(tp1.target) as client:
        got = client.score_responses(input_ids, mask, responses)
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


def test_score_groups(tp1):
    """The SDK's groups: per-continuation results equal to scoring each prompt +
    continuation alone; the NLL is the continuation's."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(1, 500, n) for n in (30, 18)]
    continuations = [[rng.integers(1, 500, n) for n in (5, 1, 9)], [rng.integers(1, 500, 7)]]
    with ScoringClient(tp1.target) as client:
        got = client.score_groups(prompts, continuations, top_k=2)
        i = 0
        for prompt, conts in zip(prompts, continuations, strict=True):
            for cont in conts:
                alone = client.score([np.concatenate([prompt, cont])]).logprobs[0]
                np.testing.assert_allclose(got.logprobs[i], alone, rtol=0, atol=1e-6)
                want_nll = -float(alone[len(prompt) :].sum())
                assert got.loss["nll"][i] == pytest.approx(want_nll, rel=1e-5)
                i += 1
        assert i == len(got.logprobs) == 4

"""Vocab-parallel logprobs / top-k (unsharded path) against plain torch."""

from __future__ import annotations

import pytest
import torch

from megascore.engine.outputs.logprobs import score_tokens


def _logprobs(logits, targets, **kwargs) -> torch.Tensor:
    return score_tokens(logits, targets, **kwargs).logprobs


def _top_k(logits, k: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    scores = score_tokens(logits, None, top_k=k, **kwargs)
    return scores.top_k_ids, scores.top_k_logprobs


def _random(num_tokens: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, vocab, generator=gen) * 3.0
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    return logits, targets


@pytest.mark.parametrize("chunk_tokens", [1, 7, 64, 4096])
def test_logprobs_match_log_softmax(chunk_tokens):
    logits, targets = _random(50, 97)
    got = _logprobs(logits, targets, tp_group=None, chunk_tokens=chunk_tokens)
    want = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_logprobs_per_token_temperature():
    logits, targets = _random(40, 64, seed=1)
    gen = torch.Generator().manual_seed(2)
    temperature = torch.rand(40, generator=gen) * 2.0 + 0.1
    got = _logprobs(logits, targets, tp_group=None, temperature=temperature, chunk_tokens=9)
    want = torch.log_softmax(logits / temperature[:, None], dim=-1)
    want = want.gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_logprobs_bf16_input_computed_in_fp32():
    logits, targets = _random(16, 300, seed=3)
    logits = logits.to(torch.bfloat16)
    got = _logprobs(logits, targets, tp_group=None)
    want = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_logprobs_extreme_logits_are_finite():
    logits = torch.zeros(3, 10)
    logits[0, 0] = 1e4
    logits[1, 5] = -1e4
    logits[2] = 80.0
    targets = torch.tensor([0, 5, 9])
    got = _logprobs(logits, targets, tp_group=None)
    want = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("k", [1, 5, 64])
@pytest.mark.parametrize("chunk_tokens", [3, 1024])
def test_top_k_matches_torch(k, chunk_tokens):
    logits, _ = _random(30, 200, seed=4)
    temperature = torch.full((30,), 0.7)
    ids, vals = _top_k(logits, k, tp_group=None, temperature=temperature, chunk_tokens=chunk_tokens)
    ref = torch.log_softmax(logits / 0.7, dim=-1)
    want_vals, want_ids = torch.topk(ref, k, dim=-1)
    assert ids.shape == (30, k) and ids.dtype == torch.int64
    torch.testing.assert_close(vals, want_vals, rtol=0, atol=1e-5)
    assert torch.equal(ids, want_ids)  # random floats: no ties


def test_top_k_ties_are_ordered_by_id_and_consistent():
    logits = torch.zeros(4, 12)
    logits[:, 3] = 2.0
    logits[1, 7] = 2.0  # tie for first place at row 1
    ids, vals = _top_k(logits, 4, tp_group=None)
    ref = torch.log_softmax(logits, dim=-1)
    # Values match torch whatever the tie order, ids are distinct and point at those values.
    torch.testing.assert_close(vals, torch.topk(ref, 4, dim=-1).values, rtol=0, atol=1e-6)
    torch.testing.assert_close(ref.gather(-1, ids), vals, rtol=0, atol=1e-6)
    for row in ids.tolist():
        assert len(set(row)) == 4
    assert ids[1, :2].tolist() == [3, 7]
    assert ids[0].tolist() == [3, 0, 1, 2]  # ties broken by ascending id


def test_top_k_excludes_padding_columns():
    logits, _ = _random(8, 20, seed=5)
    logits[:, 18:] = 100.0  # padded vocabulary columns (true vocab 18)
    ids, vals = _top_k(logits, 3, tp_group=None, vocab_size=18)
    assert (ids < 18).all()
    # Normaliser still includes the padding columns (Megatron cross-entropy semantics).
    ref = torch.log_softmax(logits, dim=-1)[:, :18]
    torch.testing.assert_close(vals, torch.topk(ref, 3, dim=-1).values, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="top_k"):
        _top_k(logits, 19, tp_group=None, vocab_size=18)


def test_score_tokens_combined_and_no_grad():
    logits, targets = _random(12, 50, seed=6)
    logits.requires_grad_(True)
    scores = score_tokens(logits, targets, tp_group=None, top_k=2, chunk_tokens=5)
    assert not scores.logprobs.requires_grad and not scores.top_k_logprobs.requires_grad
    ref = torch.log_softmax(logits.detach(), dim=-1)
    torch.testing.assert_close(
        scores.logprobs, ref.gather(-1, targets[:, None]).squeeze(-1), rtol=0, atol=1e-5
    )
    # The top-1 logprob is never below the target's.
    assert (scores.top_k_logprobs[:, 0] >= scores.logprobs - 1e-6).all()
    only_topk = score_tokens(logits.detach(), None, tp_group=None, top_k=2)
    assert only_topk.logprobs is None
    assert torch.equal(only_topk.top_k_ids, scores.top_k_ids)


def test_empty_and_bad_inputs():
    scores = score_tokens(
        torch.zeros(0, 8), torch.zeros(0, dtype=torch.long), tp_group=None, top_k=2
    )
    assert scores.logprobs.shape == (0,) and scores.top_k_ids.shape == (0, 2)
    with pytest.raises(ValueError):
        score_tokens(torch.zeros(4), None, tp_group=None)
    with pytest.raises(ValueError):
        score_tokens(torch.zeros(4, 8), torch.zeros(3, dtype=torch.long), tp_group=None)


@pytest.mark.parametrize("k", [1, 3, 16])
def test_top_k_with_many_ties_matches_lexicographic_reference(k):
    # Coarsely quantised logits: most rows tie at the k-th place, some do not.
    gen = torch.Generator().manual_seed(11)
    logits = torch.randint(0, 6, (64, 40), generator=gen).float()
    logits[::4] = torch.randn(16, 40, generator=gen)  # rows without ties
    ids, vals = _top_k(logits, k, tp_group=None, chunk_tokens=7)
    ref = torch.log_softmax(logits, dim=-1)
    for row in range(logits.shape[0]):
        # reference: order by (value descending, id ascending)
        want = sorted(range(40), key=lambda c: (-logits[row, c].item(), c))[:k]
        assert ids[row].tolist() == want, row
    torch.testing.assert_close(vals, ref.gather(-1, ids), rtol=0, atol=1e-6)


def test_top_k_of_the_whole_vocabulary():
    logits, _ = _random(5, 6, seed=12)
    ids, vals = _top_k(logits, 6, tp_group=None)
    want_vals, want_ids = torch.topk(torch.log_softmax(logits, dim=-1), 6, dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(vals, want_vals, rtol=0, atol=1e-6)


def test_chunked_top_k_with_temperature_and_padding_leaves_the_input_alone():
    logits, targets = _random(23, 40, seed=13)
    logits[:, 36:] = 50.0  # padded vocabulary columns (true vocab 36)
    before = logits.clone()
    temperature = torch.linspace(0.5, 2.0, 23)
    scores = score_tokens(
        logits, targets, tp_group=None, temperature=temperature, top_k=3, chunk_tokens=4,
        vocab_size=36,
    )  # fmt: skip
    assert torch.equal(logits, before)  # the scratch buffers never alias the caller's tensor
    ref = torch.log_softmax(logits / temperature[:, None], dim=-1)  # padding in the normaliser
    want_vals, want_ids = torch.topk(ref[:, :36], 3, dim=-1)
    assert torch.equal(scores.top_k_ids, want_ids)
    torch.testing.assert_close(scores.top_k_logprobs, want_vals, rtol=0, atol=1e-5)
    torch.testing.assert_close(
        scores.logprobs, ref.gather(-1, targets[:, None]).squeeze(-1), rtol=0, atol=1e-5
    )

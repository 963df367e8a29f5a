"""Loss registry and per-sequence losses."""

from __future__ import annotations

import numpy as np
import pytest

from megascore.api import losses
from megascore.api.layout import count_loss_tokens, effective_loss_mask
from megascore.api.losses import compute_losses, loss_names


def test_loss_names_sorted_and_include_basics():
    names = loss_names()
    assert list(names) == sorted(names)
    assert {"nll", "mean_nll", "perplexity"} <= set(names)


def test_nll_and_mean_nll_by_hand():
    lengths = np.array([3, 1, 4], np.int64)
    # NeMo-RL layout: entry 0 of each sequence is 0.0.
    logprobs = np.array([0.0, -1.0, -2.0, 0.0, 0.0, -0.5, -0.25, -4.0], np.float32)
    mask = np.array([1, 1, 0, 1, 1, 1, 1, 1], np.uint8)
    out = compute_losses(("nll", "mean_nll", "perplexity"), logprobs, lengths, mask)
    num = count_loss_tokens(lengths, mask)
    np.testing.assert_array_equal(num, [1, 0, 3])
    assert num.dtype == np.int64
    np.testing.assert_allclose(out["nll"], [1.0, 0.0, 4.75])
    np.testing.assert_allclose(out["mean_nll"], [1.0, 0.0, 4.75 / 3])
    np.testing.assert_allclose(out["perplexity"], np.exp([1.0, 0.0, 4.75 / 3]))
    assert all(v.dtype == np.float64 and v.shape == (3,) for v in out.values())


def test_no_mask_means_all_positions_after_the_first():
    lengths = np.array([2, 5], np.int64)
    rng = np.random.default_rng(0)
    logprobs = -rng.random(7).astype(np.float32)
    logprobs[[0, 2]] = 123.0  # entry 0 never contributes, whatever it holds
    out = compute_losses(["nll"], logprobs, lengths, None)
    num = count_loss_tokens(lengths, None)
    np.testing.assert_array_equal(num, [1, 4])
    np.testing.assert_allclose(out["nll"], [-logprobs[1], -logprobs[3:].astype(np.float64).sum()])


def test_effective_mask_zeroes_sequence_starts():
    mask = effective_loss_mask(np.array([1, 2, 3]), np.ones(6, np.uint8))
    np.testing.assert_array_equal(mask, [0, 0, 1, 0, 1, 1])
    with pytest.raises(ValueError):
        effective_loss_mask(np.array([2, 2]), np.ones(3, np.uint8))


def test_unknown_loss_and_duplicate_registration():
    with pytest.raises(ValueError, match="unknown loss 'bogus'"):
        compute_losses(("bogus",), np.zeros(2), np.array([2]), None)
    with pytest.raises(ValueError, match="already registered"):
        losses.register_loss("nll")(losses.nll)


def test_registered_loss_is_computed(monkeypatch):
    monkeypatch.setattr(losses, "_REGISTRY", dict(losses._REGISTRY))
    losses.register_loss("max_nll")(lambda lp, m, n: np.maximum.reduceat(-lp * m, [0, 2]))
    assert "max_nll" in loss_names()
    out = compute_losses(("max_nll",), np.array([0.0, -3.0, 0.0, -1.0]), np.array([2, 2]), None)
    np.testing.assert_allclose(out["max_nll"], [3.0, 1.0])

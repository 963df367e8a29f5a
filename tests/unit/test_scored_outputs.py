"""Entropy, caller-chosen target ids, wide top-k and rollout mismatch (issue 22), at TP1.

The engine step's numbers against a plain-torch reference on the same weights: one
sequence at a time through the model, full-vocabulary float64 log-softmax. The mismatch
statistics against an independent numpy computation from the returned logprobs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megascore.api import mismatch
from megascore.api.errors import InvalidRequestError
from megascore.api.limits import Limits
from megascore.api.types import ScoreBatch
from megascore.config import EngineConfig
from megascore.engine.schedule.step import StepConfig, StepGroups, run_step
from megascore.engine.schedule.step_output import finish_step
from megascore.model.build import build_model
from megascore.model.config import builtin_model
from tests.mismatch_reference import numpy_mismatch_stats
from tests.packed_forward import forward_packed, pack_for_rank

VOCAB = 512
LENGTHS = [9, 1, 14, 2]


@pytest.fixture(scope="module")
def model(pgs):
    return build_model(builtin_model("tiny"), EngineConfig(device="cpu"), pgs)


@pytest.fixture(scope="module")
def score(model, pgs):
    groups = StepGroups(tp=pgs.tp, cp=pgs.cp, pp=pgs.pp, status=dist.group.WORLD)
    cfg = StepConfig(pad_multiple=4, chunk_tokens=6, vocab_size=VOCAB, device="cpu")
    return lambda batch: finish_step(batch, run_step(model, batch, groups, cfg))


def _reference(model, pgs, seq: np.ndarray, temperature: float) -> torch.Tensor:
    """float64 ``[L, V]`` log-softmax of the distribution of every token given the ones
    before it (row 0: no prediction, zeros)."""
    out = forward_packed(model, pack_for_rank(torch.as_tensor(seq), [len(seq)], pgs))
    logits = out.head.logits(0, out.head.num_tokens)[: len(seq) - 1].double() / temperature
    rows = torch.zeros(len(seq), logits.shape[1], dtype=torch.float64)
    rows[1:] = torch.log_softmax(logits, dim=-1)
    return rows


def _batch(seed: int = 0, **kw) -> ScoreBatch:
    rng = np.random.default_rng(seed)
    total = sum(LENGTHS)
    return ScoreBatch(
        token_ids=rng.integers(0, VOCAB, total),
        lengths=np.array(LENGTHS),
        temperature=np.array([1.0, 0.7, 1.3, 2.0], np.float32),
        **kw,
    )


def test_entropy_target_ids_and_top_256_equal_plain_torch(model, pgs, score):
    rng = np.random.default_rng(1)
    target_ids = rng.integers(0, VOCAB, (sum(LENGTHS), 5))
    batch = _batch(return_entropy=True, target_ids=target_ids, top_k=256)
    out = score(batch)
    assert out.entropy.dtype == np.float32 and out.target_logprobs.shape == (batch.num_tokens, 5)
    bounds = batch.offsets()
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        ref = _reference(model, pgs, batch.token_ids[a:b], float(batch.temperature[i]))
        want_h = -(ref.exp() * ref).sum(-1)
        want_h[0] = 0.0
        np.testing.assert_allclose(out.entropy[a:b], want_h.numpy(), rtol=0, atol=1e-5)
        want_t = ref.gather(-1, torch.as_tensor(target_ids[a:b]))
        want_t[0] = 0.0
        np.testing.assert_allclose(out.target_logprobs[a:b], want_t.numpy(), rtol=0, atol=1e-5)
        top = torch.topk(ref[1:], 256, dim=-1)
        np.testing.assert_allclose(out.top_k_logprobs[a + 1 : b], top.values, rtol=0, atol=1e-5)
        gathered = ref[1:].gather(-1, torch.as_tensor(out.top_k_ids[a + 1 : b]))
        np.testing.assert_allclose(gathered.numpy(), top.values.numpy(), rtol=0, atol=1e-5)
        assert (out.top_k_ids[a] == -1).all() and out.entropy[a] == 0.0


def test_mismatch_statistics_equal_numpy(score):
    rng = np.random.default_rng(2)
    base = _batch()
    scored = score(base).logprobs
    rollout = scored.astype(np.float64) + rng.normal(0, 0.5, scored.size)
    mask = np.ones(base.num_tokens, np.uint8)
    mask[base.offsets()[3] :] = 0  # sequence 3 (length 2): an empty mask
    batch = _batch(
        rollout_logprobs=rollout,
        loss_mask=mask,
        mismatch_ratio_cap=np.full(4, 1.5, np.float32),
        return_importance_weights=True,
    )
    out = score(batch)
    np.testing.assert_array_equal(out.logprobs, scored)
    want = numpy_mismatch_stats(scored, rollout, LENGTHS, mask, 1.5)
    for name in mismatch.NAMES:
        np.testing.assert_allclose(out.mismatch[name], want[name], rtol=0, atol=1e-6)
    assert all(out.mismatch[name][3] == 0.0 for name in mismatch.NAMES)  # empty mask
    assert all(out.mismatch[name][1] == 0.0 for name in mismatch.NAMES)  # length 1
    d = scored.astype(np.float64) - rollout
    weights = np.minimum(np.exp(d), 1.5)
    weights[base.offsets()[:-1]] = 0.0
    np.testing.assert_allclose(out.importance_weights, weights, rtol=1e-6, atol=0)
    # a rollout equal to the scored logprobs: every statistic is zero
    same = score(_batch(rollout_logprobs=scored.astype(np.float64)))
    for name in mismatch.NAMES:
        np.testing.assert_array_equal(same.mismatch[name], 0.0)


LIMITS = Limits(VOCAB, 64, 256, ("nll",), max_target_ids=4)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"target_ids": np.zeros((26, 5), np.int64)}, "more than max_target_ids 4"),
        ({"target_ids": np.zeros((25, 2), np.int64)}, r"target_ids: shape must be \[num_tokens=26"),
        ({"target_ids": np.full((26, 2), VOCAB)}, "target_ids: sequence 0 position 1: ids"),
        ({"rollout_logprobs": np.zeros(3)}, "rollout_logprobs: 3 values, expected 26"),
        ({"return_importance_weights": True}, "needs rollout_logprobs"),
        ({"mismatch_ratio_cap": np.ones(4, np.float32)}, "mismatch_ratio_cap"),
    ],
)
def test_bad_inputs_name_the_field_and_the_sequence(kw, match):
    with pytest.raises(InvalidRequestError, match=match):
        _batch(**kw).check(LIMITS)


def test_nan_rollout_names_the_sequence():
    rollout = np.zeros(sum(LENGTHS))
    rollout[0] = np.nan  # entry 0 is ignored
    _batch(rollout_logprobs=rollout).check(LIMITS)
    rollout[12] = np.inf
    with pytest.raises(InvalidRequestError, match="rollout_logprobs: sequence 2 position 2"):
        _batch(rollout_logprobs=rollout).check(LIMITS)

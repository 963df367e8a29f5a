"""A step that returns only losses, or its per-token outputs at the masked positions only
(``logprob_positions`` masked), runs the output head only where a scored token is
predicted."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megascore.api import layout, schema
from megascore.config import EngineConfig
from megascore.engine.runtime import DistributedEngine
from megascore.engine.schedule import pipeline
from tests.one_rank import one_rank_world
from tests.prefix_groups import prefix_group_batch


@pytest.fixture(scope="module")
def engine():
    with one_rank_world():
        eng = DistributedEngine.create(EngineConfig(model="tiny", min_shared_prefix=8))
        yield eng
        eng.shutdown()


@pytest.fixture
def head_rows(monkeypatch):
    """Rows the output head computed, per microbatch."""
    rows: list[int] = []
    real = pipeline.score_tokens

    def counting(logits, *args, **kwargs):
        rows.append(logits.num_tokens)
        return real(logits, *args, **kwargs)

    monkeypatch.setattr(pipeline, "score_tokens", counting)
    return rows


@pytest.mark.parametrize("sharing", [False, True])
def test_losses_only_score_the_masked_rows(engine, head_rows, sharing):
    engine.step_cfg = dataclasses.replace(engine.step_cfg, min_shared_prefix=8 if sharing else None)
    batch = prefix_group_batch(seed=4, top_k=0)
    full = engine.score(batch)
    full_rows = sum(head_rows)
    head_rows.clear()
    losses_only = engine.score(dataclasses.replace(batch, return_logprobs=False))
    assert losses_only.logprobs is None
    for name, values in full.losses.items():
        np.testing.assert_allclose(losses_only.losses[name], values, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(losses_only.num_loss_tokens, full.num_loss_tokens)
    # 80% of the tokens are scored; the head ran on no more rows than that
    assert sum(head_rows) <= int(batch.loss_mask.sum())
    assert sum(head_rows) < 0.9 * full_rows


@pytest.mark.parametrize("sharing", [False, True])
def test_masked_positions_equal_the_dense_result_there(engine, head_rows, sharing):
    """``logprob_positions`` masked: every per-token head output (and the importance
    weights computed from the logprobs) equals the dense result at the loss mask's
    positions and holds its fill elsewhere; the head ran only on those rows; losses,
    num_loss_tokens and the mismatch statistics do not move."""
    engine.step_cfg = dataclasses.replace(engine.step_cfg, min_shared_prefix=8 if sharing else None)
    rng = np.random.default_rng(7)
    batch = prefix_group_batch(seed=5, top_k=3, return_entropy=True)
    batch = dataclasses.replace(
        batch,
        target_ids=rng.integers(0, 512, (batch.num_tokens, 2)),
        rollout_logprobs=-rng.random(batch.num_tokens) * 5,
        mismatch_ratio_cap=np.full(batch.num_sequences, 2.0, np.float32),
        return_importance_weights=True,
    )
    dense = engine.score(batch)
    head_rows.clear()
    masked = engine.score(dataclasses.replace(batch, logprob_positions=schema.MASKED))
    inside = layout.effective_loss_mask(batch.lengths, batch.loss_mask) == 1
    assert 0 < inside.sum() < batch.num_tokens
    assert sum(head_rows) <= int(inside.sum())
    for name in ("logprobs", "top_k_ids", "top_k_logprobs", "entropy", "target_logprobs",
                 "importance_weights"):  # fmt: skip
        got, want = getattr(masked, name), getattr(dense, name)
        np.testing.assert_allclose(got[inside], want[inside], rtol=0, atol=1e-6, err_msg=name)
        assert (got[~inside] == schema.output(name).fill).all(), name
    for name, values in dense.losses.items():
        np.testing.assert_allclose(masked.losses[name], values, rtol=1e-6, atol=1e-6)
    for name, values in dense.mismatch.items():
        np.testing.assert_allclose(masked.mismatch[name], values, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(masked.num_loss_tokens, dense.num_loss_tokens)

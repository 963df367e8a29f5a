"""A step that returns only losses runs the output head only where a scored token is predicted."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megascore.config import EngineConfig
from megascore.engine import pipeline
from megascore.engine.runtime import DistributedEngine
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

"""The engine on one rank: a batch's MoE / MTP metrics whatever ``--pipeline-microbatches``.

``DistributedEngine`` in process (a world of one gloo rank) scores the same tiny-moe batch
with 1, 2 and 4 microbatches: the step-level metrics (the default) agree to 1e-6;
Megatron's per-microbatch mean (``metrics_reduction="microbatch"``) moves with the count.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch.distributed as dist

from megascore.api.types import ScoreBatch
from megascore.config import EngineConfig
from megascore.engine.runtime import DistributedEngine

LENGTHS = np.array([5, 1, 17, 3, 9, 2, 12, 7])


@pytest.fixture(scope="module")
def world():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def _metrics(microbatches: int, reduction: str = "step") -> dict[str, float]:
    cfg = EngineConfig(
        model="tiny-moe", pipeline_microbatches=microbatches, metrics_reduction=reduction
    )
    engine = DistributedEngine.create(cfg)
    try:
        rng = np.random.default_rng(5)
        batch = ScoreBatch(
            token_ids=rng.integers(0, 512, int(LENGTHS.sum())),
            lengths=LENGTHS,
            return_moe_metrics=True,
            return_mtp_metrics=True,
        )
        out = engine.score(batch)
    finally:
        engine.shutdown()
    return {**out.moe_metrics, **out.mtp_metrics}


def test_metrics_equal_for_1_2_4_microbatches(world):
    one = _metrics(1)
    assert set(one) == {
        "load_balancing_loss",
        "seq_load_balancing_loss",
        "z_loss",
        "mtp_1_loss",
        "mtp_1_acceptance_rate",
    }
    for microbatches in (2, 4):
        got = _metrics(microbatches)
        for name, value in one.items():
            assert got[name] == pytest.approx(value, rel=1e-6, abs=1e-6), (microbatches, name)
    megatron_one, megatron_four = _metrics(1, "microbatch"), _metrics(4, "microbatch")
    assert megatron_one["load_balancing_loss"] == pytest.approx(one["load_balancing_loss"])
    assert megatron_four["load_balancing_loss"] != pytest.approx(
        megatron_one["load_balancing_loss"], rel=1e-4
    )

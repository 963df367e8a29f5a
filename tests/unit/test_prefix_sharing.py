"""Shared prefixes vs the dense forward on one rank (tiny-moe: MoE routing, MTP metrics).

The layouts TP2 / EP2 / PP2 / CP2 are in tests/distributed/test_prefix_sharing.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
import types

import numpy as np
import pytest
import torch

from megascore.api.types import ScoreBatch
from megascore.config import EngineConfig
from megascore.engine.layout.segment_packing import min_shared_prefix
from megascore.engine.runtime import DistributedEngine
from megascore_server.batcher import DynamicBatcher
from megascore_server.config_loader import load_serve_config
from megascore_server.shared_units import Sharing
from tests.one_rank import one_rank_world
from tests.prefix_groups import (
    MIN_SHARED,
    VOCAB,
    assert_same_metrics,
    assert_same_scores,
    prefix_group_batch,
    spy_prefix_attention,
)

BATCH = prefix_group_batch(seed=11, return_routing=True)
METRICS = dataclasses.replace(BATCH, return_moe_metrics=True, return_mtp_metrics=True)
# caller-chosen ids scored at every token: the same for every sequence of a shared prompt
# except sequence 0's token 5 (that token of its prompt can then not be shared)
TARGET_IDS = (BATCH.token_ids[:, None] + np.arange(3)) % 512
TARGET_IDS[5] = (TARGET_IDS[5] + 7) % 512
STEP_BUDGET = 640  # rows: the batcher cuts GROUPS into steps, the dense engine into more


def _groups_batch(seed: int, prompts: int = 4, n: int = 6) -> ScoreBatch:
    """GRPO groups (a 64-token prompt, n responses of 32 to 96 tokens) with MoE / MTP
    metrics: 3k tokens, in which the MTP layer accepts about ten."""
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(prompts):
        prompt = rng.integers(1, VOCAB, 64)
        seqs += [np.concatenate([prompt, rng.integers(1, VOCAB, rng.integers(32, 97))])
                 for _ in range(n)]  # fmt: skip
    return ScoreBatch(
        token_ids=np.concatenate(seqs),
        lengths=np.array([len(s) for s in seqs]),
        return_moe_metrics=True,
        return_mtp_metrics=True,
    )


GROUPS = _groups_batch(seed=12)


def _over_steps(engine, batch: ScoreBatch):
    """``batch`` as one request through the server's batcher, at :data:`STEP_BUDGET`."""

    async def submit():
        with concurrent.futures.ThreadPoolExecutor(1) as executor:
            batcher = DynamicBatcher(
                engine,
                executor,
                max_tokens_per_batch=STEP_BUDGET,
                max_batch_wait_ms=1,
                max_queue=1,
                sharing=Sharing.of(engine),
            )
            try:
                return await batcher.submit("groups", batch, arrival=time.monotonic())
            finally:
                await batcher.close()

    return asyncio.run(submit())


def _moved_route(routing: np.ndarray) -> np.ndarray:
    """The routes with one token of a shared prompt (sequence 0's token 3, shared by
    its group) replayed to other experts: that token can no longer be shared."""
    moved = routing.copy()
    moved[3] = (moved[3] + 1) % 4
    return moved


@pytest.fixture(scope="module")
def outputs():
    """Per engine (dense, shared, and shared with metrics per microbatch): the batch
    recorded, replayed with moved routes, and with MoE / MTP metrics (whether their step
    attended to prefix rows beside them)."""
    results = {}
    with one_rank_world():
        for sharing, reduction in ((False, "step"), (True, "step"), (True, "microbatch")):
            engine = DistributedEngine.create(
                EngineConfig(
                    model="tiny-moe",
                    prefix_sharing=sharing,
                    min_shared_prefix=MIN_SHARED,
                    metrics_reduction=reduction,
                    prefix_cache_gib=0,  # the step's own sharing (no prefix cache)
                )
            )
            try:
                with spy_prefix_attention() as seen:
                    metrics = engine.score(METRICS)
                if reduction == "microbatch":
                    results[reduction] = (metrics, any(seen))
                    continue
                recorded = engine.score(BATCH)
                results[sharing] = {
                    "min_shared": engine.step_cfg.min_shared_prefix,
                    "recorded": recorded,
                    "replayed": engine.score(
                        dataclasses.replace(BATCH, routing=_moved_route(recorded.routing))
                    ),
                    "metrics": (metrics, any(seen)),
                    "targets": engine.score(
                        dataclasses.replace(BATCH, target_ids=TARGET_IDS, return_entropy=True)
                    ),
                    "one_step": engine.score(GROUPS),
                    "over_steps": _over_steps(engine, GROUPS),
                }
            finally:
                engine.shutdown()
    return results


def test_the_shared_engine_shares(outputs):
    assert outputs[True]["min_shared"] == MIN_SHARED
    assert outputs[False]["min_shared"] is None


def test_shared_prefixes_score_like_the_dense_forward(outputs):
    assert_same_scores(outputs[True]["recorded"], outputs[False]["recorded"])


def test_tokens_replaying_different_routes_are_not_merged(outputs):
    # the dense engine replays sequence 0's moved route for it alone; so must the shared one
    shared, dense = outputs[True]["replayed"], outputs[False]["replayed"]
    assert np.abs(dense.logprobs - outputs[False]["recorded"].logprobs).max() > 1e-4
    assert_same_scores(shared, dense)


def test_metrics_computed_shared_are_those_of_the_dense_batch(outputs):
    (shared, shared_seen), (dense, dense_seen) = outputs[True]["metrics"], outputs[False]["metrics"]
    assert shared_seen and not dense_seen  # the metrics step attended to prefix rows
    assert_same_metrics(shared, dense)


def test_metrics_over_steps_are_the_requests_whatever_the_steps(outputs):
    """A metrics request the batcher cuts into steps (fewer when prefixes are shared)
    reports the metrics of the whole request as one step does: shared = dense within
    1e-6 relative, the MTP acceptance rate (a ratio of counts) exactly."""
    dense, shared = outputs[False]["over_steps"], outputs[True]["over_steps"]
    one_step = outputs[False]["one_step"]
    assert 1 < shared.num_steps < dense.num_steps  # the two cuts differ
    for over_steps in (dense, shared):
        assert_same_metrics(over_steps.output, one_step)
        rate = over_steps.output.mtp_metrics["mtp_1_acceptance_rate"]
        assert rate == one_step.mtp_metrics["mtp_1_acceptance_rate"] > 0


def test_metrics_per_microbatch_run_dense(outputs):
    # Megatron's per-microbatch trackers see packed rows: such a step does not share
    metrics, seen = outputs["microbatch"]
    assert not seen and metrics.moe_metrics and metrics.mtp_metrics


def test_prefix_sharing_is_on_where_asked_on_gpu_and_auto_on_cpu():
    model = types.SimpleNamespace(
        position_embedding_type="rope",
        config=types.SimpleNamespace(multi_latent_attention=False, apply_rope_fusion=False),
    )
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert min_shared_prefix(EngineConfig(prefix_sharing=True), cuda, model) == 16
    assert min_shared_prefix(EngineConfig(), cuda, model) is None  # auto: not measured there
    assert min_shared_prefix(EngineConfig(), cpu, model) == 16
    assert min_shared_prefix(EngineConfig(prefix_sharing=False), cpu, model) is None
    model.megascore_attention_backend = "te"  # TransformerEngine's attention: dense
    assert min_shared_prefix(EngineConfig(prefix_sharing=True), cuda, model) is None


def test_serve_flags():
    cfg = load_serve_config(["--no-prefix-sharing", "--min-shared-prefix", "32"], environ={})
    assert cfg.engine.prefix_sharing is False and cfg.engine.min_shared_prefix == 32
    assert load_serve_config([], environ={}).engine.prefix_sharing is None
    with pytest.raises(ValueError, match="min_shared_prefix"):
        EngineConfig(min_shared_prefix=0)


def test_entropy_and_target_ids_match_the_dense_forward(outputs):
    shared, dense = outputs[True]["targets"], outputs[False]["targets"]
    assert dense.values.keys() == shared.values.keys() >= {"entropy", "target_logprobs"}
    for name in ("entropy", "target_logprobs"):
        np.testing.assert_allclose(shared.values[name], dense.values[name], rtol=0, atol=1e-6)
    assert_same_scores(shared, dense)

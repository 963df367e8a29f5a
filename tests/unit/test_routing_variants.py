"""Record / replay on a DeepSeek-V3-style router (one rank, the engine step directly).

A dense first layer, then MoE layers with a sigmoid router, an expert-score bias that
only steers the choice (``e_score_correction_bias``), group-limited routing and a
scaling factor: the recorded routing has one entry per MoE layer (not per layer),
replaying it is bit-identical and other routes change every later logprob.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megascore.api.limits import RoutingShape
from megascore.api.types import ScoreBatch
from megascore.config import EngineConfig
from megascore.engine.outputs.routing import routing_shape
from megascore.engine.schedule.step import StepConfig, StepGroups, run_step
from megascore.engine.schedule.step_output import finish_step
from megascore.model.build import build_model
from megascore.model.config import ModelConfig

CFG = ModelConfig(
    num_layers=3,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    vocab_size=512,
    max_position_embeddings=256,
    num_moe_experts=8,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_layer_freq=[0, 1, 1],
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_num_groups=4,
    moe_router_group_topk=2,
    moe_router_topk_scaling_factor=2.5,
    moe_router_load_balancing_type="none",
)


@pytest.fixture(scope="module")
def step(pgs):
    engine_cfg = EngineConfig(pad_to_multiple_of=8)
    model = build_model(CFG, engine_cfg, pgs)
    with torch.no_grad():  # a bias that matters: it must steer the choice, not the weights
        for layer in model.decoder.layers[1:]:
            layer.mlp.router.expert_bias.copy_(torch.linspace(-0.5, 0.5, 8))
    groups = StepGroups(tp=pgs.tp, cp=pgs.cp, pp=pgs.pp, status=pgs.tp)
    cfg = StepConfig(
        pad_multiple=8, chunk_tokens=64, vocab_size=CFG.vocab_size, device=torch.device("cpu")
    )

    def score(batch: ScoreBatch):
        return finish_step(batch, run_step(model, batch, groups, cfg))

    return model, score


def _batch() -> ScoreBatch:
    rng = np.random.default_rng(7)
    lengths = np.array([6, 1, 21, 9])
    return ScoreBatch(
        token_ids=rng.integers(0, 512, int(lengths.sum())), lengths=lengths, return_routing=True
    )


def test_deepseek_style_routing_records_and_replays(step):
    model, score = step
    assert routing_shape(model) == RoutingShape(num_moe_layers=2, topk=2, num_experts=8)
    batch = _batch()
    out = score(batch)
    routes = out.routing
    assert routes.shape == (batch.num_tokens, 2, 2)  # MoE layers only, not the dense one

    again = score(dataclasses.replace(batch, routing=routes))
    assert np.array_equal(again.logprobs, out.logprobs)

    moved = routes.copy()
    moved[:, 1] = (moved[:, 1] + 4) % 8  # other groups in the last MoE layer
    other = score(dataclasses.replace(batch, routing=moved))
    changed = np.abs(other.logprobs - out.logprobs)
    assert changed.max() > 1e-4
    # The first token of each sequence has no prediction; every later one moved.
    first = np.concatenate([[0], np.cumsum(batch.lengths)[:-1]])
    rest = np.setdiff1d(np.arange(batch.num_tokens), first)
    assert (changed[rest] > 0).all()

"""Shared prefixes vs the dense forward on one rank for multi-latent attention.

MLA applies RoPE inside its attention module with a table of its own
(:func:`megascore.engine.layout.segment_packing.rope_positions` hands it over with one row per
packed position). Two tiny DeepSeek-V3 ``hf:`` checkpoints (``testkit.checkpoints``
configs): ``deepseek_v3`` (query LoRA, YaRN RoPE) and ``deepseek_v3-qfull`` (one query
projection, plain RoPE); both MoE with a sigmoid router and one MTP layer. The layouts
TP2 / CP2 / PP2 are in tests/distributed/test_prefix_sharing_mla.py.

The checkpoints keep transformers' own initialisation (std 0.02), as the built-in
models do: testkit's rescaled weights (gain 2 per matrix) amplify float32 rounding
between the shared and the dense forward to 6e-6 .. 8e-6, for a GQA family as well
(glm4_moe), above the 1e-6 bound. Without MLA's tables re-indexed, continuations are
off by ~1e-3 here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megascore.config import EngineConfig
from megascore.engine.runtime import DistributedEngine
from testkit.checkpoints import VOCAB, hf_config, save_hf_model
from tests.one_rank import one_rank_world
from tests.prefix_groups import (
    MIN_SHARED,
    assert_same_metrics,
    assert_same_scores,
    prefix_group_batch,
    spy_prefix_attention,
)

FAMILIES = ("deepseek_v3", "deepseek_v3-qfull")


def write_mla_checkpoint(family: str, directory: Path) -> None:
    """A tiny ``family`` checkpoint with transformers' initialisation (and testkit's MTP
    layer) in ``directory``."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family))
    save_hf_model(model.eval(), family, directory)


def mla_batch(seed: int):
    """:func:`tests.prefix_groups.prefix_group_batch` (routes recorded) with its token ids
    in the tiny checkpoints' vocabulary."""
    batch = prefix_group_batch(seed=seed, return_routing=True)
    return dataclasses.replace(batch, token_ids=batch.token_ids % VOCAB)


BATCH = mla_batch(seed=5)
METRICS = dataclasses.replace(BATCH, return_moe_metrics=True, return_mtp_metrics=True)


@pytest.fixture(scope="module", params=FAMILIES)
def outputs(request, tmp_path_factory):
    """Per ``prefix_sharing`` (False, True): the engine's ``min_shared_prefix``, the batch's
    scores, its scores with MoE / MTP metrics, and whether attention read prefix rows."""
    directory = tmp_path_factory.mktemp(request.param)
    write_mla_checkpoint(request.param, directory)
    results = {}
    with one_rank_world():
        for sharing in (False, True):
            engine = DistributedEngine.create(
                EngineConfig(
                    model=f"hf:{directory}",
                    prefix_sharing=sharing,
                    min_shared_prefix=MIN_SHARED,
                    prefix_cache_gib=0,  # the step's own sharing (no prefix cache)
                )
            )
            try:
                with spy_prefix_attention() as seen:
                    scores, metrics = engine.score(BATCH), engine.score(METRICS)
                results[sharing] = (engine.step_cfg.min_shared_prefix, scores, metrics, any(seen))
            finally:
                engine.shutdown()
    return results


def test_the_mla_engine_shares(outputs):
    min_shared, *_, seen = outputs[True]
    assert min_shared == MIN_SHARED and seen
    min_shared, *_, seen = outputs[False]
    assert min_shared is None and not seen


def test_shared_prefixes_score_like_the_dense_forward(outputs):
    assert_same_scores(outputs[True][1], outputs[False][1])


def test_metrics_computed_shared_are_those_of_the_dense_batch(outputs):
    assert_same_metrics(outputs[True][2], outputs[False][2])

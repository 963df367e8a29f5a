"""split_microbatches (contiguous, balanced, never shorter than the longest sequence) and
pipeline_layer_split (decoder layers per pipeline stage)."""

from __future__ import annotations

import numpy as np
import pytest

from megascore.engine.layout.microbatch_plan import split_microbatches
from megascore.model.parallel import pipeline_layer_split


def _padded(lengths, multiple):
    return -(-np.asarray(lengths) // multiple) * multiple


@pytest.mark.parametrize(
    ("lengths", "multiple", "count"),
    [
        ([5] * 8, 1, 4),
        ([3, 9, 2, 7, 7, 1, 4, 8, 8, 2], 4, 3),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], 2, 8),
        ([16] * 3, 1, 8),
    ],
)
def test_split_covers_batch_in_order_balanced(lengths, multiple, count):
    ranges, pad_to = split_microbatches(np.array(lengths), multiple, count)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(lengths)
    assert all(a < b for a, b in ranges)
    assert all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:], strict=False))
    padded = _padded(lengths, multiple)
    assert len(ranges) == min(count, len(lengths), padded.sum() // padded.max())
    sizes = [int(padded[a:b].sum()) for a, b in ranges]
    assert pad_to == max(sizes) and pad_to % multiple == 0
    # balanced: the largest microbatch is at most the even share plus one sequence
    assert pad_to <= padded.sum() / len(ranges) + padded.max()


def test_equal_sequences_split_evenly():
    ranges, pad_to = split_microbatches(np.array([4] * 8), 1, 4)
    assert ranges == [(0, 2), (2, 4), (4, 6), (6, 8)] and pad_to == 8


def test_fewer_microbatches_than_a_long_sequence_would_force():
    # one 100-token sequence among short ones: microbatches no shorter than it
    ranges, pad_to = split_microbatches(np.array([100, 5, 5, 5, 5]), 1, 4)
    assert len(ranges) == 1 and pad_to == 120
    ranges, pad_to = split_microbatches(np.array([50, 10, 20, 30, 40, 50]), 1, 8)
    assert len(ranges) == 4 and pad_to >= 50


def test_one_microbatch_is_the_whole_batch():
    assert split_microbatches(np.array([3, 1, 2]), 2, 1) == ([(0, 3)], 8)


@pytest.mark.parametrize(
    ("num_layers", "pp", "want"),
    [(4, 2, None), (5, 2, (3, 2)), (5, 4, (2, 1)), (7, 3, (3, 2)), (10, 4, (3, 3))],
)
def test_pipeline_layer_split_covers_every_layer(num_layers, pp, want):
    split = pipeline_layer_split(num_layers, pp)
    assert split == want
    if split is not None:
        middle = num_layers // pp
        assert split[0] + split[1] + (pp - 2) * middle == num_layers
        assert min(split) >= 1


def test_fewer_layers_than_stages_is_refused_naming_both():
    with pytest.raises(ValueError, match="num_layers 2 < pipeline_model_parallel_size 4"):
        pipeline_layer_split(2, 4)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_padded_microbatches_score_as_one(pgs, name):
    """Microbatches padded to a common length (a padding segment after the last sequence)
    score every sequence as one unpadded microbatch does: logprobs, top-k, losses."""
    import torch

    from megascore.api.types import ScoreBatch
    from megascore.config import EngineConfig
    from megascore.engine.schedule.step import StepConfig, StepGroups, run_step
    from megascore.engine.schedule.step_output import finish_step
    from megascore.model.build import build_model
    from megascore.model.config import builtin_model

    cfg = builtin_model(name)
    model = build_model(cfg, EngineConfig(device="cpu"), pgs)
    groups = StepGroups(tp=pgs.tp, cp=pgs.cp, pp=pgs.pp, status=pgs.tp)
    rng = np.random.default_rng(3)
    lengths = np.array([30, 3, 9, 17, 2, 25, 13])  # microbatches of 36, 36, 44 tokens
    batch = ScoreBatch(
        token_ids=rng.integers(0, cfg.vocab_size, int(lengths.sum())),
        lengths=lengths,
        temperature=rng.uniform(0.5, 1.5, len(lengths)).astype(np.float32),
        top_k=3,
        losses=("nll", "mean_nll"),
    )
    outs = []
    for count in (1, 3):
        step = StepConfig(
            pad_multiple=4,
            chunk_tokens=64,
            vocab_size=cfg.vocab_size,
            device=torch.device("cpu"),
            microbatches=count,
        )
        outs.append(finish_step(batch, run_step(model, batch, groups, step)))
    ranges, pad_to = split_microbatches(lengths, 4, 3)
    sizes = [int(_padded(lengths[a:b], 4).sum()) for a, b in ranges]
    assert sizes == [36, 36, 44] and pad_to == 44  # two microbatches get a padding segment
    one, three = outs
    np.testing.assert_allclose(three.logprobs, one.logprobs, rtol=0, atol=1e-5)
    np.testing.assert_allclose(three.top_k_logprobs, one.top_k_logprobs, rtol=0, atol=1e-5)
    for loss in one.losses:
        np.testing.assert_allclose(three.losses[loss], one.losses[loss], rtol=1e-5, atol=1e-6)

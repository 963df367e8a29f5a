"""Rank-local pieces of the engine step: layout shifts, pad multiples, validation, specs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megascore.api import layout
from megascore.config import EngineConfig
from megascore.engine.layout.microbatch import build_microbatch
from megascore.engine.layout.packing import pack_sequences
from megascore.engine.layout.prefix_tree import dense_layout, shared_layout
from megascore.engine.schedule.step_output import PredictionIndex


def test_prediction_index_shifts_right_within_each_sequence():
    lengths = [3, 1, 2]
    packed = pack_sequences(torch.arange(1, 7), lengths, pad_individual_seqs_to_multiple_of=4)
    assert packed.cu_seqlens_padded.tolist() == [0, 4, 8, 12]
    index = PredictionIndex.build(packed.token_positions, np.array(lengths))
    # values[p] = 100 * segment + position: the prediction made at packed position p
    values = torch.tensor([100 * s + p for s in range(3) for p in range(4)], dtype=torch.float32)
    flat = index.to_flat(values[:, None].expand(12, 2), fill=-7.0)
    assert flat.dtype == np.float32 and flat.shape == (6, 2)
    # seq 0: [fill, pred@0, pred@1]; seq 1: [fill]; seq 2: [fill, pred@0]
    np.testing.assert_array_equal(flat[:, 1], [-7, 0, 1, -7, -7, 200])
    ids = index.to_flat(torch.arange(12, dtype=torch.int64), fill=-1)
    assert ids.dtype == np.int64 and ids.tolist() == [-1, 0, 1, -1, -1, 8]
    assert index.to_flat(None, fill=0.0) is None


@pytest.mark.parametrize(
    ("tp", "cp", "sp", "extra", "want"),
    [
        (1, 1, False, 1, 1),
        (1, 2, False, 1, 4),
        (2, 2, True, 1, 4),
        (4, 2, True, 1, 8),
        (2, 1, True, 3, 6),
        (1, 3, False, 4, 12),
        (2, 1, None, 1, 1),  # unset: off for a dense model
    ],
)
def test_pad_multiple(tp, cp, sp, extra, want):
    cfg = EngineConfig(
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        sequence_parallel=sp,
        pad_to_multiple_of=extra,
    )
    assert cfg.pad_multiple() == want


@pytest.mark.parametrize(
    ("tp", "cp", "sp", "is_moe", "want_sp", "want_pad"),
    [
        (2, 1, None, True, True, 2),  # MoE at TP > 1: on automatically
        (4, 2, None, True, True, 8),
        (2, 1, None, False, False, 1),  # dense: off
        (1, 2, None, True, False, 4),  # TP = 1: nothing to split
        (2, 1, False, True, False, 1),  # explicit override wins
        (2, 1, True, False, True, 2),
    ],
)
def test_sequence_parallel_for(tp, cp, sp, is_moe, want_sp, want_pad):
    cfg = EngineConfig(
        tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp
    )
    assert cfg.sequence_parallel_for(is_moe) is want_sp
    assert cfg.pad_multiple(is_moe) == want_pad
    # The metrics forward of a MoE model at TP > 1 needs sequence parallelism.
    assert cfg.metrics_supported(is_moe) is (want_sp or not is_moe or tp == 1)


def test_microbatch_loss_mask_is_aligned_with_targets():
    lengths = np.array([1, 3])
    mask = layout.effective_loss_mask(lengths, np.array([1, 1, 0, 1], np.uint8)).astype(np.float32)
    mb = build_microbatch(
        dense_layout(np.array([1, 2, 3, 4]), lengths),
        None,
        mask,
        device=torch.device("cpu"),
        pad_multiple=2,
        pad_to=8,
        cp_rank=0,
        cp_size=1,
        has_request_mask=True,
    )
    # segments [0,2), [2,6) and the padding segment [6,8) up to pad_to: seq 1 tokens
    # 2,3,4 at 2,3,4; token 3 masked out, token 4 kept -> position 3 predicts it
    np.testing.assert_array_equal(mb.loss_mask.numpy(), [0, 0, 0, 1, 0, 0, 0, 0])
    assert mb.targets[2:4].tolist() == [3, 4]  # the targets of the scored positions
    assert mb.mtp_loss_mask.shape == (1, 8)


def test_identical_sequences_share_their_rows_with_both_masks():
    """Identical sequences are one segment (nothing continues it) whose rows hold the
    tokens of both: a row is scored where either sequence scores the token it predicts,
    and the MTP loss mask (a weight, step_metrics) counts the sequences that do."""
    lengths = np.array([5, 5])
    segments = shared_layout(np.tile(np.arange(1, 6), 2), lengths, min_shared=2, lead_rows=2)
    assert segments.rows_shared and not segments.shared
    # sequence 0 scores tokens 1, 2, 4; sequence 1 tokens 2, 3, 4 (token 0: no prediction)
    request_mask = np.array([1, 1, 1, 0, 1, 1, 0, 1, 1, 1], np.uint8)
    mask = layout.effective_loss_mask(lengths, request_mask).astype(np.float32)
    mb = build_microbatch(
        segments,
        None,
        mask,
        device=torch.device("cpu"),
        pad_multiple=1,
        pad_to=5,
        cp_rank=0,
        cp_size=1,
        has_request_mask=True,
        lengths=lengths,
    )
    np.testing.assert_array_equal(mb.loss_mask.numpy(), [1, 1, 1, 1, 0])  # row r: token r + 1
    np.testing.assert_array_equal(mb.mtp_loss_mask.numpy(), [[1, 2, 1, 2, 0]])


def test_microbatch_padding_is_a_segment_of_its_own():
    """Padding a microbatch up to the step's common length (pipeline parallelism) adds a
    segment of pad tokens: the last sequence keeps its own segment, so no pad token
    attends to (or is attended by) a real one and the longest segment is a sequence's."""
    lengths = np.array([3, 5])
    segments = dense_layout(np.arange(1, 9), lengths)
    common = dict(
        pad_multiple=2, cp_rank=0, cp_size=1, has_request_mask=False, device=torch.device("cpu")
    )
    mask = np.ones(8, np.float32)
    temps = np.array([0.5, 2.0], np.float32)
    mb = build_microbatch(segments, temps, mask, pad_to=20, **common)
    assert mb.packed.cu_seqlens_padded.tolist() == [0, 4, 10, 20]
    assert mb.packed.cu_seqlens.tolist() == [0, 3, 8, 8]  # the padding holds no token
    assert mb.packed.packed_seq_params.max_seqlen_q == 10  # not 16: sequence 1 + padding
    # query-key pairs of causal attention: within each segment only
    seg = np.diff(mb.packed.cu_seqlens_padded.numpy())
    real = int((seg[:2] * (seg[:2] + 1) // 2).sum())
    assert int((seg * (seg + 1) // 2).sum()) == real + 10 * 11 // 2  # not (6 + 10)^2 / 2
    np.testing.assert_array_equal(mb.temperature.numpy()[:10], [0.5] * 4 + [2.0] * 6)
    assert torch.all(mb.loss_mask[10:] == 0) and mb.packed.token_positions.tolist() == [
        0,
        1,
        2,
        4,
        5,
        6,
        7,
        8,
    ]
    exact = build_microbatch(segments, temps, mask, pad_to=10, **common)
    assert exact.packed.cu_seqlens_padded.tolist() == [0, 4, 10]  # no padding: no segment

"""Token ranks and the next token (``return_token_ranks``, ``return_next_token``) on one rank.

The engine's outputs equal a plain-torch float64 reference of each sequence alone: the
ranks exactly, the next-token ids exactly, their logprobs within 1e-5. The batch is the
prefix-sharing one (:mod:`tests.prefix_groups`: sequences that are another's prefix,
identical sequences, nested prefixes, several temperatures), scored with prefix sharing
on and off; then at the masked positions only, merged in one step with a request that
asks for neither, and through the SDK's split into parts and merge. The layouts TP2 /
CP2 / PP2 / EP2 are in :mod:`tests.e2e.test_rl_outputs_served`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megascore.api import layout, schema
from megascore.api.selection import concat_outputs, select_sequences
from megascore.config import EngineConfig
from megascore.engine.outputs.logprobs import score_tokens
from megascore.engine.runtime import DistributedEngine
from megascore.v1 import scoring_pb2 as pb
from megascore_client.inputs import make_batch
from megascore_client.splitting import ScoreOptions, build_parts, decode_part, merge
from megascore_server.batch_assembly import merge_batches
from megascore_server.convert import build_response
from tests.one_rank import one_rank_world
from tests.packed_forward import forward_packed, pack_for_rank
from tests.prefix_groups import MIN_SHARED, prefix_group_batch

BATCH = prefix_group_batch(seed=32, return_token_ranks=True, return_next_token=True, top_k=5)
MASKED = dataclasses.replace(BATCH, top_k=0, logprob_positions=schema.MASKED)
# a request asking for neither, merged in one step with one that asks for both (k = 1)
PLAIN = prefix_group_batch(seed=33, top_k=3)
ATOL = 1e-5


def _sequences(batch) -> list[np.ndarray]:
    return np.split(np.asarray(batch.token_ids), np.cumsum(batch.lengths)[:-1])


def _reference(engine, batch) -> list[np.ndarray]:
    """Per sequence, float64 ``[L, V]`` logits divided by the temperature, row t the
    distribution after token t: the sequence alone through the model, no chunked
    vocab-parallel pass."""
    net, pgs = engine.loaded.model, engine.pg_collection
    rows = []
    with torch.no_grad():
        for seq, temp in zip(_sequences(batch), batch.temperatures(), strict=True):
            out = forward_packed(net, pack_for_rank(torch.from_numpy(seq), [len(seq)], pgs))
            logits = out.head.logits(0, out.head.num_tokens)[: len(seq)]
            rows.append(logits.double().numpy() / float(temp))
    return rows


@pytest.fixture(scope="module")
def scored():
    """Per prefix sharing (off, on): the outputs of BATCH, MASKED, the merged step and its
    requests alone; and the reference logits of BATCH."""
    results = {}
    with one_rank_world():
        for sharing in (False, True):
            cfg = EngineConfig(  # the step's own sharing (no prefix cache)
                model="tiny",
                prefix_sharing=sharing,
                min_shared_prefix=MIN_SHARED,
                prefix_cache_gib=0,
            )
            engine = DistributedEngine.create(cfg)
            try:
                assert (engine.step_cfg.min_shared_prefix is not None) == sharing
                step = merge_batches(
                    [(PLAIN, np.arange(3)), (MASKED, np.array([4, 0, 2])), (PLAIN, np.array([5]))]
                )
                results[sharing] = {
                    "all": engine.score(BATCH),
                    "masked": engine.score(MASKED),
                    "step": (step, engine.score(step)),
                    "plain": engine.score(PLAIN),
                }
                if sharing:
                    results["reference"] = _reference(engine, BATCH)
            finally:
                engine.shutdown()
    return results


def _ranks(logits: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Entry t: ids whose logit after token t - 1 is >= that of token t; entry 0: 0."""
    prev = logits[:-1]
    actual = np.take_along_axis(prev, seq[1:, None], -1)
    return np.concatenate([[0], (prev >= actual).sum(-1)])


def _log_softmax(x: np.ndarray) -> np.ndarray:
    return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


def _top(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely ids of one row (ties: the lowest id first) and their logprobs."""
    ids = np.argsort(-row, kind="stable")[:k]
    return ids, _log_softmax(row)[ids]


@pytest.mark.parametrize("chunk_tokens", [1, 3, 64])
def test_a_tie_counts_against_the_token_and_padding_never_counts(chunk_tokens):
    """vLLM's rank: ids whose logit is >= the token's, the token included; the padding
    columns at or above ``vocab_size`` (here larger than every logit) never count."""
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.0, 9.0, 9.0],  # token 1 ties id 2: rank 2
            [2.0, 2.0, 2.0, 2.0, 9.0, 9.0],  # all equal: rank 4 (the whole vocabulary)
            [5.0, 1.0, 4.0, 4.5, 9.0, 9.0],  # the most likely: rank 1
            [5.0, 1.0, 4.0, 4.5, 9.0, 9.0],  # the least likely: rank 4
        ]
    )
    targets = torch.tensor([1, 3, 0, 1])
    scores = score_tokens(
        logits,
        targets,
        tp_group=None,
        temperature=torch.full((4,), 0.5),
        chunk_tokens=chunk_tokens,
        vocab_size=4,
        outputs=[schema.output("token_ranks")],
    )
    assert scores.token_ranks.dtype == torch.int64
    assert scores.token_ranks.tolist() == [2, 4, 1, 4]


def test_the_next_tokens_of_the_reference_are_unambiguous(scored):
    """The next-token ids are compared exactly: no two of each sequence's 6 most likely
    next tokens are within 1e-4 in the reference. (The ranks are compared exactly
    without such a margin: the reference has other ids within 1e-6 of a scored token.)"""
    for logits in scored["reference"]:
        top = np.sort(logits[-1])[::-1][: BATCH.top_k + 1]
        assert np.diff(top).max() < -1e-4


@pytest.mark.parametrize("sharing", [False, True])
def test_ranks_and_next_token_equal_each_sequence_alone(scored, sharing):
    out = scored[sharing]["all"]
    bounds = BATCH.offsets()
    assert out.token_ranks.dtype == np.int64 and out.token_ranks.shape == (BATCH.num_tokens,)
    assert out.next_token_ids.shape == out.next_token_logprobs.shape == (len(bounds) - 1, 5)
    assert (out.next_token_ids.dtype, out.next_token_logprobs.dtype) == (np.int64, np.float32)
    for b, (logits, seq) in enumerate(zip(scored["reference"], _sequences(BATCH), strict=True)):
        ranks = out.token_ranks[bounds[b] : bounds[b + 1]]
        np.testing.assert_array_equal(ranks, _ranks(logits, seq), err_msg=f"sequence {b}")
        # a token's logprob and its rank agree: rank 1 <=> it is the top-1
        lps = out.logprobs[bounds[b] + 1 : bounds[b + 1]]
        tops = out.top_k_logprobs[bounds[b] + 1 : bounds[b + 1], 0]
        np.testing.assert_array_equal(ranks[1:] == 1, np.abs(lps - tops) < 1e-6)
        ids, want = _top(logits[-1], 5)
        np.testing.assert_array_equal(out.next_token_ids[b], ids, err_msg=f"sequence {b}")
        np.testing.assert_allclose(out.next_token_logprobs[b], want, rtol=0, atol=ATOL)


def test_prefix_sharing_gives_the_dense_numbers(scored):
    for case in ("all", "masked"):
        dense, shared = scored[False][case], scored[True][case]
        np.testing.assert_array_equal(shared.token_ranks, dense.token_ranks)
        np.testing.assert_array_equal(shared.next_token_ids, dense.next_token_ids)
        np.testing.assert_allclose(
            shared.next_token_logprobs, dense.next_token_logprobs, rtol=0, atol=1e-6
        )


@pytest.mark.parametrize("sharing", [False, True])
def test_masked_positions_still_give_the_next_token(scored, sharing):
    """``logprob_positions`` "masked": the ranks outside the mask are 0; the next token
    (``top_k`` 0: one column) is computed after every sequence, masked there or not."""
    out, full = scored[sharing]["masked"], scored[sharing]["all"]
    outside = layout.effective_loss_mask(MASKED.lengths, MASKED.loss_mask) == 0
    assert outside.any() and (~outside).any()
    np.testing.assert_array_equal(out.token_ranks[outside], 0)
    np.testing.assert_array_equal(out.token_ranks[~outside], full.token_ranks[~outside])
    assert out.next_token_ids.shape == (MASKED.num_sequences, 1)
    np.testing.assert_array_equal(out.next_token_ids[:, 0], full.next_token_ids[:, 0])
    np.testing.assert_allclose(
        out.next_token_logprobs[:, 0], full.next_token_logprobs[:, 0], rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("sharing", [False, True])
def test_a_step_merges_requests_with_and_without_the_outputs(scored, sharing):
    """One step of a request asking for neither output (``top_k`` 3) and one asking for
    both (``top_k`` 0, masked): each cut gets what it asked for, as when scored alone."""
    step, merged = scored[sharing]["step"]
    assert (step.top_k, step.return_next_token, step.return_token_ranks) == (3, True, True)
    assert merged.next_token_ids.shape == (7, 3)
    plain = select_sequences(merged, step.lengths, np.array([0, 1, 2, 6]), PLAIN)
    assert plain.token_ranks is None and plain.next_token_ids is None
    alone = select_sequences(scored[sharing]["plain"], PLAIN.lengths, np.array([0, 1, 2, 5]), PLAIN)
    np.testing.assert_array_equal(plain.top_k_ids, alone.top_k_ids)
    np.testing.assert_allclose(plain.logprobs, alone.logprobs, rtol=0, atol=1e-6)
    # the other request: the first of the step's 3 columns; every position (the step
    # computed them all; the server then keeps its masked ones, megascore_server.pending)
    mine = select_sequences(merged, step.lengths, np.array([3, 4, 5]), MASKED)
    idx = np.array([4, 0, 2])
    alone = select_sequences(scored[sharing]["masked"], MASKED.lengths, idx, MASKED)
    every = select_sequences(scored[sharing]["all"], BATCH.lengths, idx, BATCH)
    assert mine.next_token_ids.shape == (3, 1) and mine.top_k_ids is None
    np.testing.assert_array_equal(mine.next_token_ids, alone.next_token_ids)
    np.testing.assert_allclose(
        mine.next_token_logprobs, alone.next_token_logprobs, rtol=0, atol=1e-6
    )
    np.testing.assert_array_equal(mine.token_ranks, every.token_ranks)


def test_the_sdk_splits_and_merges_them(scored):
    """A call cut into parts under a message limit that counts the next-token columns
    (``splitting.response_bytes``): each part's response encoded from its cut of the
    output, decoded by the SDK, the parts merged: the whole batch's outputs. The batcher's
    join of the cuts (:func:`concat_outputs`, in any order) gives them back too."""
    out = scored[True]["all"]
    options = ScoreOptions(top_k=5, losses=(), return_token_ranks=True, return_next_token=True)
    limit = 6000
    parts = build_parts(make_batch(_sequences(BATCH)), options, "split", max_message_bytes=limit)
    assert len(parts) > 2
    results, cuts = [], []
    for part in parts:
        idx = np.arange(part.start, part.start + len(part.lengths))
        request = dataclasses.replace(
            BATCH, token_ids=part.batch.token_ids, lengths=part.lengths, temperature=None
        )
        request = dataclasses.replace(request, loss_mask=None, losses=())
        cuts.append((idx, select_sequences(out, BATCH.lengths, idx, request)))
        response = build_response(part.request.request_id, request, cuts[-1][1], pb.Timings())
        assert response.next_top_k == 5 and response.ByteSize() < limit
        results.append(decode_part(response, part))
    result = merge(results, "split")
    assert result.next_token_ids.shape == (BATCH.num_sequences, 5)
    np.testing.assert_array_equal(result.next_token_ids, out.next_token_ids)
    np.testing.assert_array_equal(result.next_token_logprobs, out.next_token_logprobs)
    assert [len(r) for r in result.token_ranks] == BATCH.lengths.tolist()
    np.testing.assert_array_equal(np.concatenate(result.token_ranks), out.token_ranks)
    joined = concat_outputs(cuts[::-1], BATCH.lengths)
    np.testing.assert_array_equal(joined.next_token_ids, out.next_token_ids)
    np.testing.assert_array_equal(joined.token_ranks, out.token_ranks)

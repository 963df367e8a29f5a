"""Issue 4: the real server (``megascore serve`` subprocesses, CPU) scores what the engine computes.

* ``--nproc 1`` server == the engine built in this process (same model and seed),
  scored directly without gRPC;
* ``--nproc 2 --tensor-model-parallel-size 2`` server == the ``--nproc 1`` server
  and the in-process engine;
* unary, sync stream and asyncio calls of the SDK give the same numbers.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from megascore_client import AsyncScoringClient, ScoringClient, ScoringError
from testkit.reference import (
    LOSSES,
    VOCAB,
    WEIGHTS,
    assert_result_matches_output,
    assert_results_equal,
    sample_cases,
)
from tests.mismatch_reference import numpy_mismatch_stats

CASES = sample_cases()


@pytest.fixture(scope="module")
def tp1_results(shared_tp1):
    with ScoringClient(shared_tp1.target, timeout=120) as client:
        return [case.score(client) for case in CASES]


@pytest.mark.timeout(600)
def test_tp1_server_equals_in_process_engine(tp1, tp1_results, engine_reference):
    for case, result, out in zip(CASES, tp1_results, engine_reference, strict=True):
        assert_result_matches_output(result, case, out)
        assert result.timings.num_steps >= 1 and result.timings.compute_ms > 0
    # The reference itself is sane: entry 0 is 0.0, later entries are log-probabilities.
    for result in tp1_results:
        for lp in result.logprobs:
            assert lp[0] == 0.0 and (lp[1:] < 0).all() and (lp[1:] > -np.log(VOCAB) * 3).all()


@pytest.mark.timeout(600)
def test_tp2_server_equals_tp1_server_and_engine(tp2, tp1_results, engine_reference):
    with ScoringClient(tp2.target, timeout=120) as client:
        info = client.model_info()
        assert info.parallel.world_size == 2 and info.parallel.tensor_model_parallel_size == 2
        assert info.weights_version == WEIGHTS and info.vocab_size == VOCAB
        results = [case.score(client) for case in CASES]
    rows = zip(CASES, results, tp1_results, engine_reference, strict=True)
    for case, got, tp1_result, out in rows:
        assert_results_equal(got, tp1_result, atol=1e-5)
        assert_result_matches_output(got, case, out)


@pytest.mark.timeout(600)
def test_stream_and_async_equal_unary(tp2):
    with ScoringClient(tp2.target, timeout=120) as client:
        unary = [case.score(client) for case in CASES]
        with client.stream(timeout=120) as stream:
            futures = [
                stream.submit(
                    case.sequences,
                    loss_mask=case.loss_mask,
                    top_k=case.top_k,
                    temperature=case.temperature,
                    losses=LOSSES,
                    request_id=f"stream-{i}",
                )
                for i, case in enumerate(CASES)
            ]
            streamed = [f.result(timeout=120) for f in futures]

    async def run_async():
        async with AsyncScoringClient(tp2.target, timeout=120) as aclient:
            calls = [
                aclient.score(
                    case.sequences,
                    loss_mask=case.loss_mask,
                    top_k=case.top_k,
                    temperature=case.temperature,
                    losses=LOSSES,
                )
                for case in CASES
            ]
            return await asyncio.gather(*calls)

    concurrent = asyncio.run(run_async())
    for i, (a, s, c) in enumerate(zip(unary, streamed, concurrent, strict=True)):
        assert s.request_id == f"stream-{i}"
        # Concurrent calls share engine steps with other requests; the packed forward
        # keeps sequences independent, bit for bit (tests/reliability/test_load.py too).
        assert_results_equal(a, s)
        assert_results_equal(a, c)


@pytest.mark.timeout(600)
def test_invalid_input_is_rejected_by_the_real_server(tp2):
    with ScoringClient(tp2.target, timeout=60, retries=None) as client:
        with pytest.raises(ScoringError) as info:
            client.score([[1, 2, VOCAB]])
        assert info.value.code.name == "INVALID_ARGUMENT"
        assert "sequence 0 position 2" in info.value.details
        with pytest.raises(ScoringError) as info:
            client.score([[1, 2, 3]], top_k=10_000)
        assert info.value.code.name == "INVALID_ARGUMENT"
        # The replica is unharmed: a valid call still scores.
        assert client.score([[1, 2, 3]]).logprobs[0].shape == (3,)


@pytest.mark.timeout(300)
def test_dense_model_refuses_every_moe_only_option_alike(tp1):
    """``tiny`` is dense without MTP: routing, MoE metrics and MTP metrics are all
    INVALID_ARGUMENT naming the option (documented in docs/client.md), and the server
    keeps serving."""
    with ScoringClient(tp1.target, timeout=120) as client:
        info = client.model_info()
        assert not info.moe_metric_names and not info.mtp_metric_names
        for options, field in (
            ({"metrics": ("moe",)}, "options.return_moe_metrics"),
            ({"metrics": ("mtp",)}, "options.return_mtp_metrics"),
            ({"return_routing": True}, "options.return_routing"),
        ):
            with pytest.raises(ScoringError) as exc:
                client.score([[1, 2, 3]], **options)
            assert exc.value.code is grpc.StatusCode.INVALID_ARGUMENT
            assert f"{field}: the served model has no" in exc.value.details
        assert client.score([[1, 2, 3]]).lengths.tolist() == [3]


def _scored_outputs(client, seqs, rollout):
    rng = np.random.default_rng(5)
    targets = [rng.integers(0, VOCAB, (len(s), 3)) for s in seqs]
    result = client.score(
        seqs,
        top_k=256,
        return_entropy=True,
        target_ids=targets,
        rollout_logprobs=rollout,
        return_importance_weights=True,
        mismatch_ratio_cap=1.5,
    )
    return result, targets


@pytest.mark.timeout(600)
def test_entropy_target_ids_top_256_and_mismatch_through_the_sdk(tp1, tp2):
    """Issue 22 through the wire: TP2 equals TP1; the target logprobs agree with the
    top-256 where they meet; the mismatch statistics equal numpy on the returned
    logprobs (the engine's parity with plain torch: tests/unit/test_scored_outputs.py)."""
    rng = np.random.default_rng(4)
    seqs = [rng.integers(0, VOCAB, n) for n in (12, 1, 30, 5)]
    with ScoringClient(tp1.target, timeout=120) as client:
        plain = client.score(seqs)
        rollout = [lp + rng.normal(0, 0.3, lp.size) for lp in plain.logprobs]
        one, targets = _scored_outputs(client, seqs, rollout)
    with ScoringClient(tp2.target, timeout=120) as client:
        two, _ = _scored_outputs(client, seqs, rollout)
    for name in ("logprobs", "entropy", "target_logprobs", "top_k_logprobs"):
        for a, b in zip(getattr(one, name), getattr(two, name), strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    for i, seq in enumerate(seqs):
        assert one.entropy[i][0] == 0.0 and (one.entropy[i][1:] > 0).all()
        assert one.top_k_ids[i].shape == (len(seq), 256)
        # a target id inside the top-256 has the top-256's logprob
        for t in range(1, len(seq)):
            row = dict(zip(one.top_k_ids[i][t].tolist(), one.top_k_logprobs[i][t], strict=True))
            for j, tid in enumerate(targets[i][t].tolist()):
                if tid in row:
                    assert abs(one.target_logprobs[i][t, j] - row[tid]) < 1e-5
        d = one.logprobs[i][1:].astype(np.float64) - rollout[i][1:]
        stats = one.mismatch[i]
        if d.size == 0:
            assert all(v == 0.0 for v in stats.values())
            continue
        assert abs(stats["max_abs_diff"] - np.abs(d).max()) < 1e-6
        assert abs(stats["mean_abs_diff"] - np.abs(d).mean()) < 1e-6
        assert abs(stats["kl_k3"] - np.mean(np.expm1(d) - d)) < 1e-6
        assert abs(stats["mean_log_ratio"] - d.mean()) < 1e-6
        outside = np.mean((np.exp(d) > 1.5) | (np.exp(d) < 1 / 1.5))
        assert abs(stats["ratio_outside_cap"] - outside) < 1e-6
        weights = np.minimum(np.exp(d), 1.5)
        np.testing.assert_allclose(one.importance_weights[i][1:], weights, rtol=1e-6)


@pytest.mark.timeout(600)
def test_rollout_logprobs_through_the_stream_and_the_verl_adapter(tp1):
    """The streaming helper and ``score_responses`` (verl layout, ``[B, R]`` rollout
    logprobs) give the statistics of ``score`` over the response tokens."""
    rng = np.random.default_rng(6)
    prompt, resp = 4, 6
    ids = rng.integers(0, VOCAB, (3, prompt + resp))
    mask = np.ones_like(ids)
    mask[0, :2] = 0  # left-padded prompt
    mask[2, -2:] = 0  # right-padded response
    rollout = rng.normal(-3.0, 1.0, (3, resp))
    with ScoringClient(tp1.target, timeout=120) as client:
        logprobs, stats = client.score_responses(
            ids, mask, ids[:, prompt:], rollout_logprobs=rollout
        )
        seqs = [ids[b][mask[b] == 1] for b in range(3)]
        with client.stream() as stream:
            streamed = stream.submit(
                seqs,
                rollout_logprobs=[
                    np.concatenate([np.zeros(int(mask[b, :prompt].sum())), rollout[b]])[
                        : len(seqs[b])
                    ]
                    for b in range(3)
                ],
                loss_mask=[
                    (np.arange(len(seqs[b])) >= int(mask[b, :prompt].sum())).astype(np.uint8)
                    for b in range(3)
                ],
            ).result()
    for b in range(3):
        real = mask[b, prompt:] == 1
        d = logprobs[b][real].astype(np.float64) - rollout[b][real]
        assert abs(stats["mean_log_ratio"][b] - d.mean()) < 1e-6
        assert abs(stats["max_abs_diff"][b] - np.abs(d).max()) < 1e-6
        for name, values in streamed.mismatch_stats.items():
            assert abs(values[b] - stats[name][b]) < 1e-6, name


def test_rollout_logprobs_through_the_nemo_rl_adapter(tp1):
    """``score_padded`` with ``[B, S]`` rollout logprobs: per row, the statistics of its
    tokens ``1 <= t < length``, equal to numpy on the returned logprobs (a row of length
    1 has none: every statistic 0.0, as documented)."""
    rng = np.random.default_rng(7)
    lengths = np.array([5, 1, 8])
    ids = rng.integers(0, VOCAB, (3, 8))
    rollout = rng.normal(-5.0, 1.0, (3, 8))
    with ScoringClient(tp1.target, timeout=120) as client:
        logprobs, stats = client.score_padded(ids, lengths, rollout_logprobs=rollout)
    scored = np.concatenate([logprobs[b, :n] for b, n in enumerate(lengths)])
    given = np.concatenate([rollout[b, :n] for b, n in enumerate(lengths)])
    want = numpy_mismatch_stats(scored, given, lengths, None, 2.0)
    assert set(stats) == set(want)
    for name, values in want.items():
        np.testing.assert_allclose(stats[name], values, rtol=0, atol=1e-6, err_msg=name)
    assert all(stats[name][1] == 0.0 for name in want)  # length 1: no token

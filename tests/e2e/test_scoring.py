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
from tests.e2e.reference import (
    LOSSES,
    VOCAB,
    WEIGHTS,
    assert_result_matches_output,
    assert_results_equal,
    sample_cases,
)

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

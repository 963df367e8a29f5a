"""Issue 13: a pipeline-parallel replica behind the real server and the SDK.

``megascore serve --nproc 4 --pp 2 --tp 2`` (two stages of TP=2, 3 microbatches per
step) on the built-in tiny model:

* GetModelInfo and the ``megascore_model_info`` metric report PP=2;
* the SDK's results equal the engine built in this process at PP=1 (logprobs,
  top-k, losses <= 1e-5);
* hot reload under PP: ``LoadWeights("builtin:tiny@7")`` serves seed 7's numbers;
* a hung rank on the last stage (SIGSTOP) fails the next request with UNAVAILABLE
  within 30 s, health goes NOT_SERVING and the server exits non-zero.

Under ``torchrun`` (PP=2 on 2 ranks, ``-m megascore_server.main``): the same numbers,
and a SIGTERM drains both stages.

PP=2 x EP=2 (``tiny-moe`` with MTP on the last stage, MoE and MTP metrics), PP=2 x CP=2
and PP=4 (``tiny-deep``, an uneven split) are checked against one stage in the 4-rank
torchrun launch of ``tests/distributed/test_engine_pipeline.py``, with PP=2 x TP=2; a
server of their own here repeated those numbers through the serving path this module's
servers take (MoE metrics of an HF checkpoint served at PP=2:
``tests/e2e/test_family_serving.py``; MTP metrics served: the same module at TP=1).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest

from megascore.engine.layout.microbatch_plan import split_microbatches
from megascore_client import ScoringClient, ScoringError
from testkit.reference import (
    WEIGHTS,
    assert_result_matches_output,
    engine_outputs,
)
from tests.e2e.serve import assert_not_serving

PP2_TP2 = (
    "--model",
    "tiny",
    "--nproc",
    "4",
    "--pp",
    "2",
    "--tp",
    "2",
    "--pipeline-microbatches",
    "3",
    "--collective-timeout-s",
    "5",
    "--grace-s",
    "5",
)
MICROBATCHES = 3


def assert_matches_engine(result, case, out) -> None:
    """:func:`assert_result_matches_output` for any model: the same weights, the same numbers."""
    assert result.weights_version == out.weights_version
    assert_result_matches_output(
        dataclasses.replace(result, weights_version=WEIGHTS),
        case,
        dataclasses.replace(out, weights_version=WEIGHTS),
    )


@pytest.mark.timeout(600)
def test_pp2_tp2_server(serve, cases, engine_reference):
    server = serve(*PP2_TP2, metrics=True)
    server.wait_serving()
    with ScoringClient(server.target, timeout=120, retries=None) as client:
        info = client.model_info()
        assert info.parallel.world_size == 4
        assert info.parallel.pipeline_model_parallel_size == 2
        assert info.parallel.tensor_model_parallel_size == 2
        labels = 'cp="1",ep="1",model="tiny",pp="2",tp="2",world_size="4"'
        assert f"megascore_model_info{{{labels}}} 1.0" in server.metrics_text()

        for case, out in zip(cases, engine_reference, strict=True):
            assert_result_matches_output(case.score(client), case, out)

        # hot reload under PP: every stage loads its own layers of the new weights
        assert client.load_weights("builtin:tiny@7").weights_version == "builtin:tiny@7"
        case = cases[2]
        want = engine_outputs([case.batch()], model="builtin:tiny@7")[0]
        got = case.score(client)
        assert got.weights_version == "builtin:tiny@7"
        assert_matches_engine(got, case, want)

        # rank 2 is rank 0's peer on the last stage; stopped, it never takes the next step
        ranks = server.rank_pids()
        os.kill(ranks[2], signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(ScoringError) as err:
            client.score([[1, 2, 3, 4, 5]])
        elapsed = time.monotonic() - start
    assert err.value.code.name == "UNAVAILABLE", err.value
    assert elapsed <= 30, elapsed
    assert_not_serving(server)
    assert server.wait(timeout=120) != 0, server.output()
    assert not server.leftovers(), "processes left behind"


@pytest.mark.timeout(600)
def test_pp2_under_torchrun_drains_both_stages(serve, cases, engine_reference):
    server = serve("--model", "tiny", "--pp", "2", "--grace-s", "5", torchrun_nproc=2)
    server.wait_serving()
    with ScoringClient(server.target, timeout=120) as client:
        info = client.model_info()
        assert info.parallel.world_size == 2 and info.parallel.pipeline_model_parallel_size == 2
        for case, out in zip(cases, engine_reference, strict=True):
            assert_result_matches_output(case.score(client), case, out)
    code = server.terminate(timeout=120)
    log = server.output(tail=10**6)
    # the last stage (rank 1) left through rank 0's drain: SHUTDOWN broadcast, clean exit
    assert "rank 1: SHUTDOWN received, exiting" in log, log
    assert code in (0, 1, -signal.SIGTERM), (code, log)
    assert not server.leftovers(), "processes left behind"


def test_sample_cases_split_into_microbatches(cases):
    counts = [
        len(split_microbatches(case.batch().lengths, pad, MICROBATCHES)[0])
        for case in cases
        for pad in (1, 4)  # EP / PP alone; CP=2 pads each sequence to 2 x cp
    ]
    assert max(counts) == MICROBATCHES and 2 in counts, counts
    assert any(c.top_k for c in cases) and any(c.loss_mask for c in cases)
    assert {c.temperature for c in cases} != {1.0}

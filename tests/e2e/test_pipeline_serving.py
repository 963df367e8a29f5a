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
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from megascore_client import ScoringClient, ScoringError
from tests.e2e.reference import (
    assert_result_matches_output,
    assert_top_k_close,
    engine_outputs,
    split,
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
        lengths = [len(s) for s in case.sequences]
        for i, lp in enumerate(split(want.logprobs, lengths)):
            assert abs(got.logprobs[i] - lp).max() <= 1e-5
        ids, lps = split(want.top_k_ids, lengths), split(want.top_k_logprobs, lengths)
        for i in range(len(lengths)):
            assert_top_k_close(got.top_k_ids[i], got.top_k_logprobs[i], ids[i], lps[i], 1e-5)

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

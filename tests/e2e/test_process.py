"""Issue 4: ``megascore serve`` as processes: plain torchrun, and a worker rank killed.

* Under ``torchrun --nproc-per-node 2 -m megascore_server.main`` (no ``--nproc``) the
  server scores what the in-process engine computes; SIGTERM to torchrun drains both
  ranks through rank 0 and leaves no process behind.
* ``--nproc 2``: SIGKILL of the worker rank while batches are in flight makes the
  in-flight and every later request fail fast (UNAVAILABLE / INTERNAL, no hang),
  health leaves SERVING and the server exits non-zero with no process left.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest

from megascore_client import ScoringClient, ScoringError
from megascore_server.procfs import children
from testkit.reference import VOCAB, assert_result_matches_output
from tests.e2e.serve import assert_not_serving

TP2 = ("--model", "tiny", "--tensor-model-parallel-size", "2", "--grace-s", "5")
FAILED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL}
FAIL_FAST_S = 30.0


@pytest.mark.timeout(600)
def test_torchrun_serves_the_engines_numbers_and_drains_on_sigterm(serve, cases, engine_reference):
    server = serve(*TP2, torchrun_nproc=2)
    server.wait_serving()
    assert "NOT_SERVING" in server.health_seen, server.health_seen
    ranks = server.rank_pids()
    assert sorted(ranks) == [0, 1] and server.pid not in ranks.values(), ranks
    assert set(ranks.values()) <= set(children(server.pid))  # torchrun's workers
    with ScoringClient(server.target, timeout=120) as client:
        info = client.model_info()
        assert info.parallel.world_size == 2 and info.parallel.tensor_model_parallel_size == 2
        for case, out in zip(cases, engine_reference, strict=True):
            assert_result_matches_output(case.score(client), case, out)

    code = server.terminate(timeout=120)
    log = server.output(tail=10**6)
    # Both ranks left through rank 0's drain: SHUTDOWN broadcast, clean worker exit.
    assert "engine shut down" in log and "rank 1: SHUTDOWN received, exiting" in log, log
    # torchrun re-raises the signal it got after its workers exited (exit code 1 or
    # -SIGTERM, depending on the torch version); its workers are what must be clean.
    assert code in (0, 1, -signal.SIGTERM), (code, log)
    assert not server.leftovers(), "processes left behind"


def _hammer(target: str, outcomes: list, stop: threading.Event, seed: int) -> None:
    """Sends big batches one after the other until a call fails or ``stop`` is set."""
    rng = np.random.default_rng(seed)
    sequences = [rng.integers(0, VOCAB, 200).tolist() for _ in range(4)]
    with ScoringClient(target, timeout=120, retries=None) as client:
        while not stop.is_set():
            start = time.monotonic()
            try:
                client.score(sequences, top_k=4)
            except ScoringError as exc:
                outcomes.append((start, time.monotonic(), exc.code))
                return
            outcomes.append((start, time.monotonic(), grpc.StatusCode.OK))


@pytest.mark.timeout(600)
def test_killing_a_worker_rank_fails_requests_fast_and_stops_the_server(serve):
    server = serve(*TP2, "--nproc", "2")
    server.wait_serving()
    ranks = server.rank_pids()
    assert sorted(ranks) == [0, 1], ranks
    assert ranks[1] in children(server.pid) and ranks[0] in children(server.pid)

    outcomes: list[list] = [[] for _ in range(4)]
    stop = threading.Event()
    threads = [
        threading.Thread(target=_hammer, args=(server.target, outcomes[i], stop, i), daemon=True)
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    end = time.monotonic() + 300
    while sum(len(o) for o in outcomes) < 3:  # the replica is busy with full steps
        assert time.monotonic() < end, "no call completed"
        assert all(o[-1][2] is grpc.StatusCode.OK for o in outcomes if o), outcomes
        time.sleep(0.05)

    killed_at = time.monotonic()
    os.kill(ranks[1], signal.SIGKILL)
    for thread in threads:
        thread.join(FAIL_FAST_S + 30)
    stop.set()
    assert not any(thread.is_alive() for thread in threads), "a call hung after the kill"
    last = [o[-1] for o in outcomes]
    # Every client's last call failed with a lost-rank code, within the fail-fast bound;
    # the calls in flight at the kill either finished just before it or failed.
    for _, ended, code in last:
        assert code in FAILED, last
        assert ended - killed_at < FAIL_FAST_S, (ended - killed_at, last)
    in_flight = [o for calls in outcomes for o in calls if o[0] < killed_at < o[1]]
    assert in_flight and any(code in FAILED for _, _, code in in_flight), outcomes

    # New requests fail fast too (health first says NOT_SERVING, then the port closes).
    with ScoringClient(server.target, timeout=FAIL_FAST_S, retries=None) as client:
        start = time.monotonic()
        with pytest.raises(ScoringError) as info:
            client.score([[1, 2, 3]])
        assert info.value.code in FAILED and time.monotonic() - start < FAIL_FAST_S
    assert_not_serving(server)
    code = server.wait(timeout=60)
    assert code != 0, server.output()
    assert not server.leftovers(), "processes left behind"

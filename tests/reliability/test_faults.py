"""Issue 7 (CI-short): faults of a real ``megascore serve`` replica.

* A worker rank hangs (SIGSTOP): the collective timeout (``--collective-timeout-s``)
  fires, requests fail with UNAVAILABLE, the server exits non-zero and the launcher
  kills the stopped rank (no process left).
* SIGTERM while clients keep sending: every call ends OK (bit-identical to its
  reference) or UNAVAILABLE ("server shutting down", never CANCELLED), none
  hangs or is cut off; calls in flight finish; a Health/Watch
  stream sees SERVING -> NOT_SERVING and ends (it does not hold the drain for the
  grace period); the server exits 0 and no process is left.
* A client disconnects in the middle of a stream (call cancelled, client process
  SIGKILLed): the shared server keeps serving the same answers, with the same ranks.

The worker kill during a batch is ``tests/e2e/test_process.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from megascore.api.wire import encode_array
from megascore.v1 import scoring_pb2 as pb
from megascore_client import ScoringClient, ScoringError
from megascore_server.procfs import children
from testkit.load import make_cases
from testkit.reference import assert_results_equal
from tests.e2e.serve import ROOT, SERVING, assert_not_serving

TP2 = ("--model", "tiny", "--nproc", "2", "--tensor-model-parallel-size", "2")
COLLECTIVE_TIMEOUT_S = 10
GRACE_S = 60


def _score_in_thread(target: str, sequences, outcome: list) -> threading.Thread:
    def run():
        start = time.monotonic()
        with ScoringClient(target, timeout=120, retries=None) as client:
            try:
                client.score(sequences)
                outcome.append((grpc.StatusCode.OK, time.monotonic() - start))
            except ScoringError as exc:
                outcome.append((exc.code, time.monotonic() - start))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(600)
def test_hung_worker_trips_the_collective_timeout(serve):
    server = serve(*TP2, "--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S), "--grace-s", "5")
    server.wait_serving()
    ranks = server.rank_pids()
    assert ranks[1] in children(server.pid)
    with ScoringClient(server.target, timeout=120, retries=None) as client:
        client.score([[1, 2, 3, 4]])
    # A big batch is (most likely) mid-step when the worker stops; the small one that
    # follows finds the worker hung between steps. close() SIGCONTs / SIGKILLs it.
    big, small = [], []
    threads = [_score_in_thread(server.target, [list(range(500))] * 16, big)]
    time.sleep(0.3)
    os.kill(ranks[1], signal.SIGSTOP)
    stopped_at = time.monotonic()
    threads.append(_score_in_thread(server.target, [[5, 6, 7, 8, 9]], small))
    for thread in threads:
        thread.join(150)
    waited = time.monotonic() - stopped_at
    assert big and small, "a call hung"
    # Rank 0 gives up after the collective timeout (send to the hung worker, or the
    # TP all-reduce then the status all-reduce of 3 x the timeout): well before the
    # 120 s client deadline. A batch that finished before the stop is fine too.
    assert big[0][0] in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE), big
    assert small[0][0] is grpc.StatusCode.UNAVAILABLE, small
    assert waited < 4 * COLLECTIVE_TIMEOUT_S + 30, (waited, big, small)
    assert_not_serving(server)
    code = server.wait(timeout=120)  # the launcher SIGKILLs the stopped rank
    assert code != 0, server.output()
    assert not server.leftovers(), "processes left behind"


def _watch_health(target: str, seen: list, ready: threading.Event) -> None:
    """Records every status of a Health/Watch stream, then "END" (or the error code)."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            for response in stub.Watch(health_pb2.HealthCheckRequest(), timeout=300):
                seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))
                ready.set()
            seen.append("END")
        except grpc.RpcError as exc:
            seen.append(exc.code().name)
        ready.set()


def _client_loop(target, cases, refs, outcomes: list, stop: threading.Event, offset: int):
    """Scores cases until a call fails or ``stop``; records (start, end, code, equal)."""
    with ScoringClient(target, timeout=60, retries=None) as client:
        for i in range(offset, offset + 10_000):
            if stop.is_set():
                return
            case, ref = cases[i % len(cases)], refs[i % len(refs)]
            start = time.monotonic()
            try:
                result = case.score(client)
            except ScoringError as exc:
                outcomes.append((start, time.monotonic(), exc.code, None))
                return
            try:
                assert_results_equal(result, ref)
                equal = True
            except AssertionError:
                equal = False
            outcomes.append((start, time.monotonic(), grpc.StatusCode.OK, equal))


@pytest.mark.timeout(600)
def test_sigterm_under_load_drains_and_exits_zero(serve):
    server = serve(*TP2, "--grace-s", str(GRACE_S))
    server.wait_serving()
    ranks = server.rank_pids()
    cases = make_cases(6, seed=3, max_len=200)
    with ScoringClient(server.target, timeout=120) as client:
        refs = [case.score(client) for case in cases]
    seen: list[str] = []
    watching = threading.Event()
    watcher = threading.Thread(
        target=_watch_health, args=(server.target, seen, watching), daemon=True
    )
    watcher.start()
    assert watching.wait(30) and seen[0] == "SERVING", seen

    outcomes: list[list] = [[] for _ in range(4)]
    stop = threading.Event()
    clients = [
        threading.Thread(
            target=_client_loop,
            args=(server.target, cases, refs, outcomes[i], stop, 2 * i),
            daemon=True,
        )
        for i in range(4)
    ]
    for thread in clients:
        thread.start()
    end = time.monotonic() + 300
    while sum(len(o) for o in outcomes) < 4:
        assert time.monotonic() < end, "no call completed"
        time.sleep(0.05)

    sigterm_at = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.wait(timeout=GRACE_S + 90)
    drained_in = time.monotonic() - sigterm_at
    stop.set()
    for thread in clients:
        thread.join(90)
    watcher.join(30)
    assert not any(thread.is_alive() for thread in clients), "a call never ended"

    calls = [call for per_client in outcomes for call in per_client]
    codes = {c for _, _, c, _ in calls}
    # New calls get UNAVAILABLE during the drain, before grpc core stops: none is
    # CANCELLED by it (docs/reliability.md).
    assert codes <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, calls
    assert all(equal for _, _, c, equal in calls if c is grpc.StatusCode.OK), calls
    # Calls already running when SIGTERM came finished within the grace period.
    in_flight = [call for call in calls if call[0] < sigterm_at < call[1]]
    finished = [call for call in in_flight if call[2] is grpc.StatusCode.OK]
    assert finished, f"no in-flight call completed after SIGTERM: {in_flight}"
    assert code == 0, server.output()
    assert not server.leftovers(), "processes left behind"
    assert not any(pid in server.tree() for pid in ranks.values())
    # The watcher saw the drain, and its open stream ended then: it did not hold the
    # drain for the whole grace period (nor did anything else once the calls finished).
    assert seen == ["SERVING", "NOT_SERVING", "END"], seen
    assert drained_in < GRACE_S / 2, f"drain took {drained_in:.1f} s of {GRACE_S} s grace"
    log = server.output(tail=10**6)
    assert "engine shut down" in log and "rank 1: SHUTDOWN received, exiting" in log, log


DISCONNECTING_CLIENT = """
import sys, time
from megascore_client import ScoringClient
with ScoringClient(sys.argv[1], timeout=300) as client:
    stream = client.stream(timeout=300)
    futures = [stream.submit([[i % 500] * 400] * 6, top_k=8) for i in range(12)]
    print("submitted", flush=True)
    time.sleep(300)
"""


@pytest.mark.timeout(600)
def test_client_disconnects_mid_stream_server_keeps_serving(tp2):
    ranks = tp2.rank_pids()
    cases = make_cases(3, seed=5)
    with ScoringClient(tp2.target, timeout=120) as client:
        refs = [case.score(client) for case in cases]

    # 1. The client cancels its stream after the first answer.
    request = pb.ScoreRequest(
        request_id="cancelled-stream",
        token_ids=encode_array(np.arange(2400, dtype=np.int64) % 500),
        lengths=encode_array(np.full(6, 400, dtype=np.int64)),
        options=pb.ScoreOptions(return_logprobs=True, top_k=8),
    )
    call = tp2.stub().ScoreStream(iter([request] * 10), timeout=120)
    first = next(call)
    assert first.request_id == "cancelled-stream"
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    assert info.value.code() is grpc.StatusCode.CANCELLED

    # 2. A client process dies (SIGKILL) with 12 batches submitted on its stream.
    proc = subprocess.Popen(
        [sys.executable, "-c", DISCONNECTING_CLIENT, tp2.target],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        assert proc.stdout.readline().strip() == "submitted"
        time.sleep(0.5)
        proc.kill()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()

    # The server answers the same numbers, with the same ranks, and its queue drains.
    with ScoringClient(tp2.target, timeout=120) as client:
        for case, ref in zip(cases, refs, strict=True):
            assert_results_equal(case.score(client), ref)
    assert tp2.running() and tp2.rank_pids() == ranks
    assert tp2.health() == SERVING
    end = time.monotonic() + 60
    while "megascore_queue_depth 0.0" not in tp2.metrics_text():
        assert time.monotonic() < end, "the abandoned stream's work never left the queue"
        time.sleep(0.5)

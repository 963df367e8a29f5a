"""MoE routing out and in through a real ``megascore serve --model tiny-moe --nproc 2 --tp 2``.

The routing travels SDK -> server -> broadcast protocol -> both ranks (TP=2 with
sequence parallelism: each rank's routers see half the tokens) and back:

* SDK: ``return_routing=True`` gives one ``[L, 2, 2]`` array per sequence; replaying it
  (``routing=``) for the same batch gives bit-identical logprobs, and the same values up
  to float rounding when the call is split into several requests (other engine steps);
  other valid routes change them; a bad routing is refused naming the field
  and the sequence, and the server keeps serving;
* CLI: ``megascore score --return-routing`` writes the SDK's routes; the output rows fed
  back as input (their ``routing`` replayed, in other batches) give the same logprobs;
  a row with a bad routing is named by FILE:LINE.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from megascore_client import ScoringClient, ScoringError

MEGASCORE = Path(sys.executable).with_name("megascore")  # the venv's console script
MOE_TP2 = ("--model", "tiny-moe", "--nproc", "2", "--tensor-model-parallel-size", "2")
VOCAB = 512


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    from tests.e2e.serve import ServeProcess

    server = ServeProcess(tmp_path_factory.mktemp("moe") / "serve.log", *MOE_TP2)
    try:
        server.wait_serving()
        yield server
    finally:
        server.close()


def _sequences(seed: int = 0, num: int = 6) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(n)) for n in rng.integers(1, 40, num)]


@pytest.mark.timeout(600)
def test_sdk_records_and_replays_routing(moe_server):
    seqs = _sequences()
    with ScoringClient(moe_server.target, timeout=120) as client:
        first = client.score(seqs, top_k=2, return_routing=True)
        assert [r.shape for r in first.routing] == [(len(s), 2, 2) for s in seqs]
        assert all(r.dtype == np.int32 and r.min() >= 0 and r.max() < 4 for r in first.routing)

        again = client.score(seqs, top_k=2, routing=first.routing, return_routing=True)
        for i in range(len(seqs)):
            np.testing.assert_array_equal(again.logprobs[i], first.logprobs[i])
            np.testing.assert_array_equal(again.top_k_logprobs[i], first.top_k_logprobs[i])
            np.testing.assert_array_equal(again.routing[i], first.routing[i])

        other = [(r + 1) % 4 for r in first.routing]
        moved = client.score(seqs, routing=other)
        assert any(
            np.abs(moved.logprobs[i] - first.logprobs[i]).max() > 1e-4
            for i in range(len(seqs))
            if len(seqs[i]) > 1
        )

    # Split into one request per sequence or so: the routes are cut and rejoined.
    with ScoringClient(moe_server.target, timeout=120, max_request_tokens=40) as client:
        split = client.score(seqs, routing=first.routing, return_routing=True)
        assert split.timings.num_requests > 1
        for i in range(len(seqs)):  # other steps: equal up to the CPU BLAS's rounding
            np.testing.assert_allclose(split.logprobs[i], first.logprobs[i], rtol=0, atol=1e-5)
            np.testing.assert_array_equal(split.routing[i], first.routing[i])

        bad = [r.copy() for r in first.routing]
        bad[2][0, 1, 0] = 9
        with pytest.raises(ScoringError) as info:
            client.score(seqs[:3], routing=bad[:3])
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "routing: sequence " in info.value.details  # of its request (a split call)
        assert "expert ids must be in [0, 4)" in info.value.details
        assert info.value.sequence_index == 2  # in the call's batch
        assert client.score(seqs[:1]).logprobs is not None  # still serving


def _cli(target: str, src: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [str(MEGASCORE), "score", "--target", target, str(src), "-o", str(out),
           "--batch-tokens", "48", "--no-progress", *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.timeout(600)
def test_cli_writes_and_replays_routing(moe_server, tmp_path):
    seqs = _sequences(seed=1, num=7)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "token_ids": s.tolist()}) + "\n"
                           for i, s in enumerate(seqs)))  # fmt: skip
    done = _cli(moe_server.target, src, out, "--return-routing")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    with ScoringClient(moe_server.target, timeout=120) as client:
        ref = client.score(seqs, return_routing=True)
    for i, row in enumerate(rows):
        np.testing.assert_array_equal(np.asarray(row["routing"]), ref.routing[i])

    # The output rows as input: odd rows replay their routes, even rows route again.
    replay_src, replay_out = tmp_path / "replay.jsonl", tmp_path / "replay_out.jsonl"
    replay_src.write_text("".join(
        json.dumps({"id": r["id"], "token_ids": seqs[i].tolist(),
                    **({"routing": r["routing"]} if i % 2 else {})}) + "\n"
        for i, r in enumerate(rows)
    ))  # fmt: skip
    done = _cli(moe_server.target, replay_src, replay_out, "--return-routing")
    assert done.returncode == 0, done.stderr
    replayed = [json.loads(line) for line in replay_out.read_text().splitlines()]
    assert [r["id"] for r in replayed] == list(range(len(seqs)))
    for row, new in zip(rows, replayed, strict=True):  # other batches than the first run
        np.testing.assert_allclose(new["logprobs"], row["logprobs"], rtol=0, atol=1e-5)
        assert new["routing"] == row["routing"]

    bad_src, bad_out = tmp_path / "bad.jsonl", tmp_path / "bad_out.jsonl"
    routes = np.asarray(rows[1]["routing"])
    routes[0, 0] = [3, 3]
    bad_src.write_text(
        json.dumps({"id": "ok", "token_ids": seqs[0].tolist()}) + "\n"
        + json.dumps({"id": "dup", "token_ids": seqs[1].tolist(), "routing": routes.tolist()})
        + "\n"
    )  # fmt: skip
    stopped = _cli(moe_server.target, bad_src, bad_out)
    assert stopped.returncode == 1
    assert f'{bad_src}:2 (id "dup"): refused: ' in stopped.stderr, stopped.stderr
    assert "distinct" in stopped.stderr

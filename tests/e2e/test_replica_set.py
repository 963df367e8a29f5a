"""Issue 25: weights across two ``megascore serve --model tiny`` replicas (CPU).

* Version pins: one replica reloads seed 7 (``builtin:tiny@7``); through the SDK's
  round robin over both, a request pinned to either version is always answered by
  the replica serving it (the other refuses it and the SDK re-sends it), with that
  replica's own numbers; a pin no replica serves fails with FAILED_PRECONDITION
  naming both versions, and both replicas keep serving.
* One push to both (``ipv4:a,b``, two phases): a partial push of the final norm
  (Megatron name) switches both; every later response carries the new version and
  the same logprobs from either replica, different from the old ones. When one
  replica refuses (a push of its own is open there: ABORTED), the push fails naming
  it and neither switches; both keep scoring with the old weights. The asyncio
  client's push switches both the same way.
* Delta pushes (bf16 tensors, Megatron names, to both): after a full push that the
  replicas keep, a delta of the same tensors with 1% of the elements changed sends
  <= 5% of the full push's bytes, and the logprobs it serves are bit-identical to a
  full push of the same weights.
* Three replicas, the third started with another model (``tiny-moe``: a deploy
  mistake): a full push of the tiny weights is refused by the third (a tensor its
  model does not have), and one killed (SIGKILL) while a push streams to all three:
  each time the push fails naming that replica, and every other replica keeps its
  old version, answering with bit-identical logprobs; the survivors then take the
  next push.

The tests run in any order: each starts with both ``tiny`` replicas serving
``builtin:tiny@1234`` (loaded again by the fixture), and the killed third replica is a
fourth server of its own.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest

from megascore.v1 import scoring_pb2 as pb
from megascore_client import AsyncScoringClient, ScoringClient, ScoringError
from tests.e2e.serve import ServeProcess

pytestmark = pytest.mark.timeout(900)

SEQS = [[1, 5, 9, 200, 31], [7, 7, 300, 2]]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two ``tiny`` replicas, a third on ``tiny-moe`` and a fourth (the one killed), started
    at once."""
    log_dir = tmp_path_factory.mktemp("replicas")
    models = ("tiny", "tiny", "tiny-moe", "tiny-moe")
    procs = [ServeProcess(log_dir / f"r{i}.log", "--model", m) for i, m in enumerate(models)]
    try:
        for server in procs:
            server.wait_serving()
        yield procs
    finally:
        for server in procs:
            server.close()


@pytest.fixture
def replicas(servers):
    """The two ``tiny`` replicas, serving ``builtin:tiny@1234`` again (whatever another
    test of the module pushed or loaded)."""
    for server in servers[:2]:
        with ScoringClient(server.target, timeout=120) as client:
            client.load_weights("builtin:tiny@1234")
    return servers[:2]


@pytest.fixture
def odd(servers):
    """The third replica (``tiny-moe``), checked alive."""
    assert servers[2].running(), servers[2].output()
    return servers[2]


@pytest.fixture
def victim(servers):
    """The fourth replica (``tiny-moe``), the one a test kills."""
    assert servers[3].running(), servers[3].output()
    return servers[3]


def round_robin(servers) -> ScoringClient:
    target = "ipv4:" + ",".join(s.target for s in servers)
    return ScoringClient(target, load_balancing="round_robin", timeout=60)


def test_pinned_requests_are_answered_by_the_replica_serving_their_version(replicas):
    first, second = replicas
    with ScoringClient(second.target, timeout=120) as direct:
        seeded = direct.load_weights("builtin:tiny@7").weights_version
        want_new = direct.score(SEQS, losses=())
    with ScoringClient(first.target, timeout=60) as direct:
        want_old = direct.score(SEQS, losses=())
    old = want_old.weights_version
    assert (old, seeded) == ("builtin:tiny@1234", "builtin:tiny@7")
    with round_robin(replicas) as client:
        for _ in range(4):
            for version, want in ((old, want_old), (seeded, want_new)):
                got = client.score(SEQS, losses=(), weights_version=version)
                assert got.weights_version == version
                for a, b in zip(got.logprobs, want.logprobs, strict=True):
                    np.testing.assert_array_equal(a, b)
        with pytest.raises(ScoringError) as info:
            client.score(SEQS, weights_version="builtin:tiny@99")
        assert info.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "'builtin:tiny@99'" in info.value.details
        assert {client.score(SEQS).weights_version for _ in range(4)} == {old, seeded}
    with ScoringClient(second.target, timeout=120) as direct:
        assert direct.load_weights("builtin:tiny@1234").weights_version == old


NORM = "decoder.final_layernorm.weight"
HIDDEN = 64  # the built-in tiny model


def scored_by_each(replicas) -> list:
    out = []
    for server in replicas:
        with ScoringClient(server.target, timeout=60) as direct:
            out.append(direct.score(SEQS, losses=()))
    return out


def test_one_push_switches_every_replica_or_none(replicas):
    before = scored_by_each(replicas)
    old = before[0].weights_version
    norm = np.full(HIDDEN, 1.5, dtype=np.float32)
    with round_robin(replicas) as client:
        result = client.push_weights(
            [(NORM, norm)], names="megatron", partial=True, weights_version="both-1"
        )
        assert [r.weights_version for r in result.replicas] == ["both-1", "both-1"]
        answers = [client.score(SEQS, losses=()) for _ in range(4)]
    assert {a.weights_version for a in answers} == {"both-1"}
    after = scored_by_each(replicas)
    for got in after:
        assert got.weights_version == "both-1"
        for a, b in zip(got.logprobs, after[0].logprobs, strict=True):
            np.testing.assert_array_equal(a, b)
    assert not np.array_equal(after[0].logprobs[0], before[0].logprobs[0])

    # the second replica refuses: a push of its own holds its one push slot
    release = threading.Event()

    def held():
        yield pb.UpdateWeightsRequest(begin=pb.UpdateWeightsBegin(names=pb.WEIGHT_NAMES_MEGATRON))
        release.wait(60)

    holder = replicas[1].stub().UpdateWeights.future(held(), timeout=120)
    try:
        with round_robin(replicas) as client:
            with pytest.raises(ScoringError) as info:
                client.push_weights(
                    [(NORM, norm * 2)], names="megatron", partial=True, weights_version="both-2"
                )
            assert info.value.code is grpc.StatusCode.ABORTED
            assert f"replica {replicas[1].target}" in info.value.details
            assert "no replica switched" in info.value.details
    finally:
        release.set()
        holder.cancel()
    for got in scored_by_each(replicas):
        assert got.weights_version == "both-1"
        for a, b in zip(got.logprobs, after[0].logprobs, strict=True):
            np.testing.assert_array_equal(a, b)
    assert old == "builtin:tiny@1234"


def test_the_async_client_pushes_to_both(replicas):
    import asyncio

    norm = np.full(HIDDEN, 1.25, dtype=np.float32)

    async def push():
        target = "ipv4:" + ",".join(s.target for s in replicas)
        async with AsyncScoringClient(target, timeout=60) as client:
            return await client.push_weights(
                [(NORM, norm)], names="megatron", partial=True, weights_version="async-1"
            )

    result = asyncio.run(push())
    assert [r.weights_version for r in result.replicas] == ["async-1", "async-1"]
    after = scored_by_each(replicas)
    assert [got.weights_version for got in after] == ["async-1", "async-1"]
    for a, b in zip(after[0].logprobs, after[1].logprobs, strict=True):
        np.testing.assert_array_equal(a, b)


EMBEDDING = "embedding.word_embeddings.weight"


def test_a_delta_push_sends_little_and_serves_what_a_full_push_serves(replicas):
    import torch

    gen = torch.Generator().manual_seed(25)
    weights = {
        EMBEDDING: (torch.randn(512, HIDDEN, generator=gen) * 0.05).to(torch.bfloat16),
        NORM: (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(torch.bfloat16),
    }
    with round_robin(replicas) as client:
        full = client.push_weights(
            weights.items(), names="megatron", partial=True, delta=True, weights_version="d0"
        )
        assert not full.delta
        base = client.score(SEQS, losses=(), weights_version="d0")
        changed = {name: t.clone() for name, t in weights.items()}
        flat = changed[EMBEDDING].view(-1)
        picked = torch.randperm(flat.numel(), generator=gen)[: flat.numel() // 100]
        flat[picked] += 0.25  # 1% of the embedding's elements (bf16 bits change)
        delta = client.push_weights(
            changed.items(), names="megatron", partial=True, delta=True, weights_version="d1"
        )
        assert delta.delta and delta.weights_version == "d1"
        assert delta.num_bytes <= 0.05 * full.num_bytes, (delta.num_bytes, full.num_bytes)
        by_delta = [client.score(SEQS, losses=(), weights_version="d1") for _ in range(2)]
        client.push_weights(changed.items(), names="megatron", partial=True, weights_version="f1")
        by_full = [client.score(SEQS, losses=(), weights_version="f1") for _ in range(2)]
    for got in by_delta + by_full[1:]:
        for a, b in zip(got.logprobs, by_full[0].logprobs, strict=True):
            np.testing.assert_array_equal(a, b)
    assert not np.array_equal(by_full[0].logprobs[0], base.logprobs[0])  # the change shows


def assert_unchanged(before, after) -> None:
    """Each replica answers with the version and bit-identical logprobs it had before."""
    for old, new in zip(before, after, strict=True):
        assert new.weights_version == old.weights_version
        for a, b in zip(new.logprobs, old.logprobs, strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_replica_refusing_a_tensor_fails_the_push_and_nothing_switches(replicas, odd):
    group = [*replicas, odd]
    before = scored_by_each(group)
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"  # dense: tiny-moe has experts there
    tensors = [(NORM, np.full(HIDDEN, 0.5, np.float32)), (fc1, np.ones((256, HIDDEN), np.float32))]
    with ScoringClient(replicas[0].target, timeout=60) as client:
        with pytest.raises(ScoringError) as info:
            client.push_weights(
                tensors, names="megatron", partial=True, replicas=[s.target for s in group]
            )
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details
    assert f"replica {odd.target} failed" in details and fc1 in details, details
    assert "no replica switched" in details
    assert_unchanged(before, scored_by_each(group))


def wait_for_push_in_progress(server, timeout: float = 30.0) -> None:
    """Returns once ``server`` refuses a push of its own as "in progress" (an empty
    stream: when no push is open it is refused at once, as not starting with begin)."""
    end = time.monotonic() + timeout
    while True:
        try:
            server.stub().UpdateWeights(iter([]), timeout=10)
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.ABORTED and "in progress" in exc.details():
                return
        assert time.monotonic() < end, "the push never reached the replica"
        time.sleep(0.05)


def test_a_replica_killed_mid_push_fails_it_and_the_others_keep_scoring(replicas, victim):
    before = scored_by_each(replicas)
    rng = np.random.default_rng(7)
    streamed = []

    def tensors():
        """Three tensors in 4 KiB chunks; the third replica is killed after the first,
        once it holds the push open (a second push there is refused as in progress)."""
        for name, shape in ((EMBEDDING, (512, HIDDEN)), ("output_layer.weight", (512, HIDDEN))):
            yield name, (rng.standard_normal(shape) * 0.05).astype(np.float32)
            streamed.append(name)
            if len(streamed) == 1:
                wait_for_push_in_progress(victim)
                os.kill(victim.pid, signal.SIGKILL)
                victim.proc.wait(30)
        yield NORM, np.full(HIDDEN, 0.5, np.float32)

    targets = [s.target for s in (*replicas, victim)]
    with ScoringClient(replicas[0].target, timeout=60) as client:
        with pytest.raises(ScoringError) as info:
            client.push_weights(
                tensors(), names="megatron", partial=True, chunk_bytes=4096, replicas=targets
            )
    assert info.value.code is grpc.StatusCode.UNAVAILABLE, info.value
    assert f"replica {victim.target} failed" in info.value.details
    assert "no replica switched" in info.value.details
    assert victim.proc.returncode == -signal.SIGKILL
    assert_unchanged(before, scored_by_each(replicas))
    with round_robin(replicas) as client:  # both keep scoring, and take the next push
        assert {client.score(SEQS).weights_version for _ in range(4)} == {before[0].weights_version}
        norm = np.full(HIDDEN, 0.75, np.float32)
        result = client.push_weights([(NORM, norm)], names="megatron", partial=True)
        assert len(result.replicas) == 2
        assert client.score(SEQS).weights_version == result.weights_version

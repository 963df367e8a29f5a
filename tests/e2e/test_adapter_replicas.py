"""Issue 46: a LoRA adapter's push (``push_adapter``) over a replica set of 2, all or none,
as the full push (``tests/e2e/test_replica_set.py``), through real ``megascore serve``
replicas on a tiny llama ``hf:`` checkpoint with a peft adapter ``policy`` (CPU).

* A push to a healthy set of 2 commits on both: each serves the new adapter version, both
  answer bit for bit alike (and differently than before), the base set is untouched.
* One replica killed (SIGKILL) during the push: it is stopped (SIGSTOP) once every tensor
  went out, so the other replica prepares the push (its log says so) while the victim never
  answers; then it is killed. The push fails naming the victim, and the survivor still
  serves the adapter's previous version: its answers bit for bit the previous ones, its
  ``ModelInfo`` and ``/v1/models`` versions unchanged; it dropped the prepared push (its
  log says "aborted") and takes the next push at once, which commits on it and the healthy
  second replica alike.
* A new adapter (one no replica serves) refused by one replica (its push slot is held):
  neither replica lists it afterwards.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import grpc
import numpy as np
import pytest

from megascore.v1 import scoring_pb2 as pb
from megascore_client import ScoringClient, ScoringError
from megascore_server.ports import pick_port
from testkit.checkpoints import token_batch, write_hf_checkpoint
from tests.checkpoint.lora_cases import ATTENTION, peft_model
from tests.e2e.serve import ServeProcess
from tests.e2e.test_replica_set import wait_for_push_in_progress
from tests.e2e.test_weight_sets_served import _http

pytestmark = pytest.mark.timeout(900)

LORA = dict(r=4, lora_alpha=8, target_modules=ATTENTION)  # ~14 KiB of fp32 tensors
NAME = "policy"
ABORTED = re.compile(r"prepared push \w+ aborted")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Three replicas of base + ``policy`` (seed 1), started at once: the first with an
    HTTP port, the third the one a test kills."""
    root = tmp_path_factory.mktemp("adapter-replicas")
    write_hf_checkpoint("llama", root / "base")
    peft_model("llama", 1, **LORA).save_pretrained(root / NAME)
    flags = ["--model", f"hf:{root / 'base'}", "--adapter", f"{NAME}={root / NAME}"]
    flags += ["--max-batch-wait-ms", "1"]
    http_port = pick_port()
    extra = (["--http-port", str(http_port)], [], [])
    procs = [ServeProcess(root / f"r{i}.log", *flags, *x) for i, x in enumerate(extra)]
    try:
        for server in procs:
            server.wait_serving()
        yield procs, http_port
    finally:
        for server in procs:
            server.close()


@pytest.fixture(scope="module")
def seqs():
    return token_batch(batch=2).numpy().tolist()


def adapter(seed: int):
    """``policy``'s state dict and config, its LoRA tensors drawn from ``seed``."""
    from peft import get_peft_model_state_dict

    model = peft_model("llama", seed, **LORA)
    return get_peft_model_state_dict(model), model.peft_config["default"]


def scored(server, seqs, model: str = NAME):
    with ScoringClient(server.target, timeout=120) as client:
        return client.score(seqs, model=model, losses=())


def versions(server) -> dict[str, str]:
    """``ModelInfo``'s served names -> weights versions."""
    with ScoringClient(server.target, timeout=120) as client:
        return {m.name: m.weights_version for m in client.model_info().models}


def assert_same(got, want) -> None:
    assert got.weights_version == want.weights_version
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_adapter_push_to_a_healthy_set_of_two_commits_on_both(servers, seqs):
    (first, second, _), _ = servers
    base = [scored(s, seqs, "") for s in (first, second)]
    before = scored(first, seqs)
    state, config = adapter(2)
    with ScoringClient(f"ipv4:{first.target},{second.target}", timeout=120) as client:
        result = client.push_adapter(NAME, state, config, weights_version="healthy-1")
    assert [r.weights_version for r in result.replicas] == ["healthy-1", "healthy-1"]
    after = [scored(s, seqs) for s in (first, second)]
    assert [a.weights_version for a in after] == ["healthy-1", "healthy-1"]
    assert_same(after[1], after[0])
    assert not np.array_equal(after[0].logprobs[0], before.logprobs[0])
    for server, was in zip((first, second), base, strict=True):
        assert versions(server)[NAME] == "healthy-1"
        assert_same(scored(server, seqs, ""), was)  # the base set is not the adapter


def test_a_replica_killed_mid_adapter_push_leaves_the_survivor_on_the_previous_one(servers, seqs):
    (survivor, second, victim), http_port = servers
    assert victim.running(), victim.output()
    previous = scored(survivor, seqs)
    known = versions(survivor)
    state, config = adapter(3)
    total = sum(t.numel() * t.element_size() for t in state.values())
    prepared_before = survivor.output(10**7).count(" prepared (push ")
    aborted_before = len(ABORTED.findall(survivor.output(10**7)))
    killer: list[threading.Thread] = []

    def kill_once_the_survivor_prepared():
        end = time.monotonic() + 60
        while survivor.output(10**7).count(" prepared (push ") == prepared_before:
            assert time.monotonic() < end, survivor.output()
            time.sleep(0.05)
        os.kill(victim.pid, signal.SIGKILL)

    def progress(sent: int, name: str) -> None:
        """After the last chunk went out: the victim (which holds the push open) stops, so
        it never prepares; it is killed once the survivor did."""
        if sent == total and not killer:
            wait_for_push_in_progress(victim)
            os.kill(victim.pid, signal.SIGSTOP)
            killer.append(threading.Thread(target=kill_once_the_survivor_prepared))
            killer[0].start()

    with ScoringClient(survivor.target, timeout=120) as client:
        with pytest.raises(ScoringError) as info:
            client.push_adapter(
                NAME, state, config, weights_version="killed-1", chunk_bytes=1024,
                progress=progress, replicas=[survivor.target, victim.target],
            )  # fmt: skip
    killer[0].join(60)
    assert info.value.code is grpc.StatusCode.UNAVAILABLE, info.value
    assert f"replica {victim.target} failed" in info.value.details
    assert "no replica switched" in info.value.details
    assert victim.proc.wait(30) == -signal.SIGKILL

    assert_same(scored(survivor, seqs), previous)
    assert versions(survivor) == known
    status, listed = _http(http_port, "/v1/models")
    assert status == 200
    cards = {card["id"]: card["weights_version"] for card in listed["data"]}
    assert cards[NAME] == known[NAME] == previous.weights_version, cards
    log = survivor.output(10**7)
    assert log.count(" prepared (push ") == prepared_before + 1, log
    assert len(ABORTED.findall(log)) == aborted_before + 1, log  # dropped, not held

    # the survivor holds no prepared push: the next push commits on it (and a healthy peer)
    with ScoringClient(f"ipv4:{survivor.target},{second.target}", timeout=120) as client:
        result = client.push_adapter(NAME, state, config, weights_version="after-kill")
    assert [r.weights_version for r in result.replicas] == ["after-kill", "after-kill"]
    after = [scored(s, seqs) for s in (survivor, second)]
    assert_same(after[1], after[0])
    assert after[0].weights_version == "after-kill"
    assert not np.array_equal(after[0].logprobs[0], previous.logprobs[0])


def test_a_new_adapter_refused_by_one_replica_is_served_by_none(servers, seqs):
    (first, second, _), _ = servers
    release = threading.Event()

    def held():
        yield pb.UpdateWeightsRequest(begin=pb.UpdateWeightsBegin(names=pb.WEIGHT_NAMES_MEGATRON))
        release.wait(60)

    holder = second.stub().UpdateWeights.future(held(), timeout=120)
    try:
        wait_for_push_in_progress(second)
        state, config = adapter(4)
        with ScoringClient(f"ipv4:{first.target},{second.target}", timeout=120) as client:
            with pytest.raises(ScoringError) as info:
                client.push_adapter("fresh", state, config, weights_version="fresh-1")
        assert info.value.code is grpc.StatusCode.ABORTED, info.value
        assert f"replica {second.target}" in info.value.details
        assert "no replica switched" in info.value.details
    finally:
        release.set()
        holder.cancel()
    for server in (first, second):
        assert "fresh" not in versions(server)
        with pytest.raises(ScoringError) as missing:
            scored(server, seqs, "fresh")
        assert missing.value.code is grpc.StatusCode.NOT_FOUND

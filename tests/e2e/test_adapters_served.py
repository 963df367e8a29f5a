"""LoRA adapters through a real ``megascore serve --adapter NAME=DIR`` and the SDK / HTTP.

One server on a tiny llama ``hf:`` checkpoint with four peft adapters (``tests/checkpoint/
lora_cases.py``): a request naming an adapter = transformers + peft (<= 1e-4, fp32); five
concurrent requests of four adapters and the base run in one step and each equals its
answer alone, bit for bit; ``model=adapter, reference=default`` gives the base's logprobs
and the KL estimators of numpy; a pushed adapter (``push_adapter``) moves its bytes only
and scores as the same tensors loaded from a directory (``load_weights(adapter=)``);
unknown names are NOT_FOUND / HTTP 404; ``/v1/models`` lists the adapters with ``parent``.
"""

from __future__ import annotations

import concurrent.futures
import re

import grpc
import numpy as np
import pytest

from megascore_client import ScoringClient, ScoringError
from megascore_server.ports import pick_port
from megascore_server.serve_process import CPU_ONE_THREAD
from testkit.checkpoints import token_batch, write_hf_checkpoint
from tests.checkpoint.lora_cases import FOUR as LORAS
from tests.checkpoint.lora_cases import peft_model, write_adapter
from tests.e2e.test_weight_sets_served import _http, assert_kl


def _steps(server) -> float:
    return float(re.search(r"^megascore_steps_total (\S+)$", server.metrics_text(), re.M)[1])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server (with HTTP and metrics), the peft logprobs and the directories."""
    from megascore_server.serve_process import ServeProcess

    root = tmp_path_factory.mktemp("adapters")
    write_hf_checkpoint("llama", root / "base")
    ids, want = token_batch(batch=2), {}
    flags = ["--model", f"hf:{root / 'base'}", "--max-batch-wait-ms", "500"]
    for name, (seed, lora) in LORAS.items():
        want[name], want["base"] = write_adapter("llama", root / name, ids, seed, **lora)
        flags += ["--adapter", f"{name}={root / name}"]
    http_port = pick_port()
    server = ServeProcess(
        root / "serve.log", *flags, "--http-port", str(http_port), env=CPU_ONE_THREAD, metrics=True
    )
    try:
        server.wait_serving()
        yield server, http_port, ids.numpy().tolist(), want, root
    finally:
        server.close()


def test_a_request_naming_an_adapter_equals_peft(served):
    server, _, seqs, want, _ = served
    with ScoringClient(server.target, timeout=120) as client:
        for name in [*LORAS, "base"]:
            got = client.score(seqs, model="" if name == "base" else name)
            for row, expected in zip(got.logprobs, want[name], strict=True):
                np.testing.assert_allclose(row[1:], expected, rtol=0, atol=1e-4, err_msg=name)
        assert client.score(seqs, model="a").weights_version.startswith("adapter-")


def test_four_adapters_and_the_base_share_one_step_bit_for_bit(served):
    server, _, _, _, _ = served
    names = ["a", "", "b", "c", "d"]
    seqs = token_batch(seed=1, batch=5).numpy().tolist()
    with ScoringClient(server.target, timeout=120) as client:
        alone = [client.score([s], model=n).logprobs[0] for s, n in zip(seqs, names, strict=True)]
        before = _steps(server)
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            futures = [
                pool.submit(client.score, [s], model=n) for s, n in zip(seqs, names, strict=True)
            ]
            together = [f.result().logprobs[0] for f in futures]
        assert _steps(server) - before == 1  # one step for all five
    for got, want in zip(together, alone, strict=True):
        np.testing.assert_array_equal(got, want)


def test_policy_adapter_with_the_base_as_reference_gives_the_kl(served):
    server, _, seqs, _, _ = served
    with ScoringClient(server.target, timeout=120) as client:
        base = client.score(seqs)
        kl = client.score(seqs, model="a", reference="default")
        policy = client.score(seqs, model="a")
    assert_kl(kl, base, policy)


def test_a_pushed_adapter_moves_its_bytes_and_equals_it_loaded(served):
    from peft import get_peft_model_state_dict

    server, _, seqs, _, root = served
    model = peft_model("llama", 9, **LORAS["b"][1])
    model.save_pretrained(root / "pushed")
    state = get_peft_model_state_dict(model)
    adapter_bytes = sum(t.numel() * t.element_size() for t in state.values())
    with ScoringClient(server.target, timeout=120) as client:
        before = client.score(seqs, model="b")
        try:
            pushed = client.push_adapter(
                "b", state, model.peft_config["default"], weights_version="b-1"
            )
            assert pushed.weights_version == "b-1"
            assert adapter_bytes <= pushed.num_bytes <= adapter_bytes * 1.02
            after = client.score(seqs, model="b")
            loaded = client.load_weights(str(root / "pushed"), adapter="loaded")
            assert loaded.weights_version.startswith("adapter-")
            same = client.score(seqs, model="loaded")
            info = client.model_info()
        finally:  # "b" as the server started with it: the module's other tests compare it
            client.load_weights(str(root / "b"), adapter="b")
        restored = client.score(seqs, model="b")
    assert after.weights_version == "b-1"
    for i in range(len(seqs)):
        np.testing.assert_array_equal(after.logprobs[i], same.logprobs[i])
        assert not np.array_equal(after.logprobs[i], before.logprobs[i])
        np.testing.assert_array_equal(restored.logprobs[i], before.logprobs[i])
    listed = {m.name: m.base for m in info.models}
    assert listed["loaded"] == listed["b"] == "default"


def test_unknown_names_and_the_http_model_list(served):
    server, port, seqs, _, _ = served
    with ScoringClient(server.target, timeout=120) as client:
        with pytest.raises(ScoringError, match="nope") as caught:
            client.score(seqs, model="nope")
        assert caught.value.code == grpc.StatusCode.NOT_FOUND
    status, listed = _http(port, "/v1/models")
    assert status == 200
    parents = {card["id"]: card.get("parent") for card in listed["data"]}
    assert all(parents[name] == "default" for name in LORAS), parents
    body = {"prompt": seqs, "echo": True, "logprobs": 0, "max_tokens": 0}
    assert _http(port, "/v1/completions", {**body, "model": "a"})[0] == 200
    status, missing = _http(port, "/v1/completions", {**body, "model": "nope"})
    assert status == 404 and "'nope'" in missing["error"]["message"], missing

"""Named weight sets through a real ``megascore serve --weights ...`` and the SDK / HTTP.

One server holds ``reference`` (the default, ``builtin:tiny@1``) and ``policy``
(``builtin:tiny@2``): the SDK's ``model`` selects a set (the same bits as a server of that
set alone would give: as the one-set server's default), ``reference`` adds the reference's
logprobs and the KL estimators in the same call, an unknown name is NOT_FOUND naming it
and the server keeps serving; over HTTP, ``/v1/models`` lists the sets, the OpenAI
``model`` field selects one and an unknown one is a 404 naming it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from megascore_client import ScoringClient, ScoringError
from megascore_server.ports import pick_port
from megascore_server.serve_process import CPU_ONE_THREAD

SEQUENCES = [[1, 5, 9, 13, 17, 21, 25], [2, 4, 6, 8, 10, 12, 14, 16, 18]]


def assert_kl(kl, reference, policy) -> None:
    """``kl``'s reference logprobs are ``reference``'s bit for bit, its k3 and mean k1 are
    numpy's on the two answers' logprobs (float64, <= 1e-12)."""
    for i in range(len(reference.logprobs)):
        np.testing.assert_array_equal(kl.reference_logprobs[i], reference.logprobs[i])
        r = reference.logprobs[i].astype(np.float64) - policy.logprobs[i].astype(np.float64)
        r[0] = 0.0
        np.testing.assert_allclose(kl.kl_k3[i], np.expm1(r) - r, rtol=0, atol=1e-12)
        np.testing.assert_allclose(kl.kl_mean["k1"][i], np.mean(-r[1:]), rtol=0, atol=1e-12)


def _http(port: int, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The two-set server (with an HTTP port) and a one-set server of ``policy``'s weights."""
    from megascore_server.serve_process import ServeProcess

    log = tmp_path_factory.mktemp("sets")
    http_port = pick_port()
    flags = ("--weights", "reference=builtin:tiny@1", "--weights", "policy=builtin:tiny@2")
    both = ServeProcess(log / "sets.log", *flags, "--http-port", str(http_port), env=CPU_ONE_THREAD)
    alone = ServeProcess(log / "alone.log", "--model", "builtin:tiny@2", env=CPU_ONE_THREAD)
    try:
        both.wait_serving()
        alone.wait_serving()
        yield both, alone, http_port
    finally:
        both.close()
        alone.close()


def test_the_sdk_selects_a_set_and_gets_the_reference_kl(servers):
    both, alone, _ = servers
    with ScoringClient(both.target, timeout=120) as client, ScoringClient(alone.target) as single:
        info = client.model_info()
        assert [m.name for m in info.models] == ["reference", "policy"]
        policy = client.score(SEQUENCES, model="policy")
        expected = single.score(SEQUENCES)
        for got, want in zip(policy.logprobs, expected.logprobs, strict=True):
            np.testing.assert_array_equal(got, want)
        assert policy.weights_version == "builtin:tiny@2"
        reference = client.score(SEQUENCES)  # the default set
        kl = client.score(SEQUENCES, model="policy", reference="reference")
        assert_kl(kl, reference, policy)
        assert (kl.weights_version, kl.reference_weights_version) == (
            "builtin:tiny@2",
            "builtin:tiny@1",
        )
        assert policy.reference_weights_version == ""
        with pytest.raises(ScoringError, match="nope") as caught:
            client.score(SEQUENCES, model="nope")
        assert caught.value.code == grpc.StatusCode.NOT_FOUND
        assert client.score(SEQUENCES, model="policy").weights_version == "builtin:tiny@2"


def test_http_lists_the_sets_and_takes_the_model_field(servers):
    both, _, port = servers
    status, listed = _http(port, "/v1/models")
    assert status == 200
    assert [card["id"] for card in listed["data"]][1:] == ["policy"]
    body = {"prompt": SEQUENCES, "echo": True, "logprobs": 0, "max_tokens": 0}
    status, policy = _http(port, "/v1/completions", {**body, "model": "policy"})
    assert status == 200, policy
    status, reference = _http(port, "/v1/completions", {**body, "model": "reference"})
    assert status == 200, reference
    lp = [
        c["logprobs"]["token_logprobs"][1:] for c in (policy["choices"][0], reference["choices"][0])
    ]
    assert lp[0] != lp[1]
    assert "reference_weights_version" not in policy["megascore"]
    asked = {**body, "model": "policy", "megascore": {"reference": "reference"}}
    status, kl = _http(port, "/v1/completions", asked)
    assert status == 200, kl
    versions = kl["megascore"]["weights_version"], kl["megascore"]["reference_weights_version"]
    assert versions == ("builtin:tiny@2", "builtin:tiny@1")
    status, generated = _http(
        port, "/generate", {"input_ids": SEQUENCES, "megascore": {"reference": "reference"}}
    )
    assert status == 200, generated
    assert generated[0]["meta_info"]["reference_weights_version"] == "builtin:tiny@1"
    status, missing = _http(port, "/v1/completions", {**body, "model": "nope"})
    assert status == 404 and "'nope'" in missing["error"]["message"], missing
    assert _http(port, "/v1/completions", body)[0] == 200  # still serving

"""Issue 7 (CI-short): TLS, mutual TLS and the bearer token on a real ``megascore serve``.

One subprocess server with ``--tls-cert/--tls-key`` (certificates generated here with
``cryptography``), ``--tls-client-ca`` (mTLS) and ``--auth-token-file``:

* without a token or with a wrong one, every Scorer RPC is UNAUTHENTICATED; health
  and reflection stay open; the right token scores;
* a client trusting another CA, a client without a certificate, a client whose
  certificate another CA signed, and a plaintext client all fail the handshake.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from megascore.api.wire import encode_array
from megascore.v1 import scoring_pb2 as pb
from megascore.v1 import scoring_pb2_grpc as pb_grpc
from megascore_client import ScoringClient, ScoringError, TlsConfig
from tests.e2e.serve import ServeProcess
from tests.pki import make_pki

TOKEN = "e2e-token-0123456789"
SCORE = pb.ScoreRequest(
    request_id="sec",
    token_ids=encode_array(np.array([1, 2, 3, 4, 5], dtype=np.int64)),
    lengths=encode_array(np.array([2, 3], dtype=np.int64)),
    options=pb.ScoreOptions(return_logprobs=True),
)


def credentials(pki, root="server_ca", client="client") -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=pki[root],
        private_key=pki[f"{client}_key"] if client else None,
        certificate_chain=pki[f"{client}_cert"] if client else None,
    )


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    """The TLS + mTLS + token server, and the PKI."""
    directory = tmp_path_factory.mktemp("secure")
    pki, _ = make_pki(directory)
    (directory / "token").write_text(TOKEN + "\n")
    server = ServeProcess(
        directory / "serve.log",
        "--model",
        "tiny",
        "--grace-s",
        "5",
        "--tls-cert",
        str(directory / "server_cert.pem"),
        "--tls-key",
        str(directory / "server_key.pem"),
        "--tls-client-ca",
        str(directory / "client_ca.pem"),
        "--auth-token-file",
        str(directory / "token"),
        credentials=credentials(pki),
    )
    try:
        server.wait_serving()
        yield server, pki
        assert server.terminate(timeout=60) == 0, server.output()
        assert not server.leftovers()
    finally:
        server.close()
    assert TOKEN not in server.output(tail=10**7)  # never logged


def every_scorer_rpc(stub: pb_grpc.ScorerStub, metadata) -> dict[str, grpc.RpcError | None]:
    """Calls each Scorer RPC once; method -> the error (None when it succeeded)."""
    calls = {
        "Score": lambda: stub.Score(SCORE, timeout=30, metadata=metadata),
        "ScoreStream": lambda: list(stub.ScoreStream(iter([SCORE]), timeout=30, metadata=metadata)),
        "GetModelInfo": lambda: stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=30, metadata=metadata
        ),
        "LoadWeights": lambda: stub.LoadWeights(
            pb.LoadWeightsRequest(model="tiny@7"), timeout=30, metadata=metadata
        ),
    }
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except grpc.RpcError as exc:
            errors[name] = exc
    return errors


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", "Bearer wrong-token"),), (("authorization", TOKEN),)],
    ids=["no-token", "wrong-token", "no-bearer-prefix"],
)
def test_scorer_rpcs_without_the_token_are_unauthenticated(secure, metadata):
    server, pki = secure
    with grpc.secure_channel(server.target, credentials(pki)) as channel:
        errors = every_scorer_rpc(pb_grpc.ScorerStub(channel), metadata)
        for name, error in errors.items():
            assert error is not None, f"{name} succeeded without the token"
            assert error.code() is grpc.StatusCode.UNAUTHENTICATED, (name, error)
        # Health and reflection stay open (probes, grpcurl).
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=30, metadata=metadata
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (answer,) = reflection.ServerReflectionInfo(iter([request]), timeout=30)
        assert "megascore.v1.Scorer" in {s.name for s in answer.list_services_response.service}


@pytest.mark.timeout(600)
def test_the_token_over_mtls_scores(secure):
    server, pki = secure
    tls = TlsConfig(
        root_ca=pki["server_ca"], client_cert=pki["client_cert"], client_key=pki["client_key"]
    )
    with ScoringClient(server.target, tls=tls, token=TOKEN, timeout=60) as client:
        assert client.health().serving
        result = client.score([[1, 2], [3, 4, 5]], top_k=2)
        assert [lp.shape for lp in result.logprobs] == [(2,), (3,)]
        assert client.model_info().name == "tiny"
    with ScoringClient(server.target, tls=tls, token="wrong", timeout=60) as client:
        with pytest.raises(ScoringError) as info:
            client.score([[1, 2, 3]])
        assert info.value.code is grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("root", "client"),
    [("rogue_ca", "client"), ("server_ca", None), ("server_ca", "rogue"), (None, None)],
    ids=["wrong-ca", "no-client-cert", "client-cert-of-another-ca", "plaintext"],
)
def test_bad_transport_credentials_fail_the_handshake(secure, root, client):
    server, pki = secure
    if root is None:
        channel = grpc.insecure_channel(server.target)
    else:
        channel = grpc.secure_channel(server.target, credentials(pki, root, client))
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    with channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.ScorerStub(channel).Score(SCORE, timeout=15, metadata=metadata)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE, info.value
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=15)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    assert server.running()

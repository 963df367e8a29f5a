"""Bearer-token auth, TLS / mTLS (certificates generated per test run), message size limit."""

from __future__ import annotations

import logging

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from megascore.v1 import scoring_pb2 as pb
from megascore.v1 import scoring_pb2_grpc as pb_grpc
from megascore_server.config import GrpcServerConfig
from megascore_server.tls import is_loopback, server_credentials, warn_if_exposed
from tests.pki import make_pki
from tests.service.fake_engine import FakeEngine
from tests.service.harness import Req, ServerThread, check_response

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """``(pem, paths)`` of a throwaway PKI (:func:`tests.pki.make_pki`)."""
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls_stub(srv: ServerThread, root: bytes, key: bytes | None = None, cert: bytes | None = None):
    creds = grpc.ssl_channel_credentials(
        root_certificates=root, private_key=key, certificate_chain=cert
    )
    channel = grpc.secure_channel(
        srv.address, creds, options=[("grpc.ssl_target_name_override", "localhost")]
    )
    srv._channels.append(channel)
    return pb_grpc.ScorerStub(channel)


def assert_fails(fn, code=grpc.StatusCode.UNAVAILABLE):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == code
    return info.value


REQ = Req([[1, 2, 3], [4, 5]], request_id="sec")


def test_tls(pki):
    files, paths = pki
    srv = ServerThread(
        FakeEngine(),
        GrpcServerConfig(port=0, tls_cert=paths["server_cert"], tls_key=paths["server_key"]),
    )
    try:
        check_response(tls_stub(srv, files["server_ca"]).Score(REQ.proto(), timeout=10), REQ)
        assert_fails(lambda: tls_stub(srv, files["rogue_ca"]).Score(REQ.proto(), timeout=10))
        assert_fails(lambda: srv.stub().Score(REQ.proto(), timeout=10))  # plaintext client
    finally:
        srv.stop()


def test_mtls(pki):
    files, paths = pki
    config = GrpcServerConfig(
        port=0,
        tls_cert=paths["server_cert"],
        tls_key=paths["server_key"],
        tls_client_ca=paths["client_ca"],
    )
    srv = ServerThread(FakeEngine(), config)
    try:
        ok = tls_stub(srv, files["server_ca"], files["client_key"], files["client_cert"])
        check_response(ok.Score(REQ.proto(), timeout=10), REQ)
        assert_fails(lambda: tls_stub(srv, files["server_ca"]).Score(REQ.proto(), timeout=10))
        rogue = tls_stub(srv, files["server_ca"], files["rogue_key"], files["rogue_cert"])
        assert_fails(lambda: rogue.Score(REQ.proto(), timeout=10))
    finally:
        srv.stop()


def test_tls_file_errors(tmp_path):
    with pytest.raises(ValueError, match="tls_cert: cannot read"):
        server_credentials(GrpcServerConfig(tls_cert=str(tmp_path / "nope.pem"), tls_key="k"))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="not a PEM file"):
        server_credentials(GrpcServerConfig(tls_cert=str(tmp_path / "junk.pem"), tls_key="k"))
    with pytest.raises(ValueError, match="given together"):
        GrpcServerConfig(tls_cert="a.pem")
    with pytest.raises(ValueError, match="mTLS"):
        GrpcServerConfig(tls_client_ca="ca.pem")


# -------------------------------------------------------------------------- auth


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN + "\n")
    srv = ServerThread(FakeEngine(), auth_token_file=str(token_file))
    yield srv
    srv.stop()


def every_rpc(stub, metadata):
    return [
        lambda: stub.Score(REQ.proto(), timeout=5, metadata=metadata),
        lambda: list(stub.ScoreStream(iter([REQ.proto()]), timeout=5, metadata=metadata)),
        lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5, metadata=metadata),
        lambda: stub.LoadWeights(
            pb.LoadWeightsRequest(model="hf:/x"), timeout=5, metadata=metadata
        ),
    ]


@pytest.mark.parametrize(
    "metadata",
    [None, [("authorization", "Bearer wrong")], [("authorization", TOKEN)], [("x-api-key", TOKEN)]],
    ids=["missing", "wrong", "no-bearer-prefix", "other-header"],
)
def test_auth_rejects_every_rpc(auth_server, metadata):
    for call in every_rpc(auth_server.stub(), metadata):
        error = assert_fails(call, grpc.StatusCode.UNAUTHENTICATED)
        assert "authorization: Bearer" in error.details()
    assert all(kind != "load" for kind, _ in auth_server.engine.events)


def test_auth_accepts_token_and_leaves_health_open(auth_server):
    good = [("authorization", f"Bearer {TOKEN}")]
    stub = auth_server.stub()
    check_response(stub.Score(REQ.proto(), timeout=5, metadata=good), REQ)
    responses = list(stub.ScoreStream(iter([REQ.proto()]), timeout=5, metadata=good))
    check_response(responses[0], REQ)
    assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5, metadata=good).name == "fake"
    assert auth_server.health() == health_pb2.HealthCheckResponse.SERVING
    health_stub = health_pb2_grpc.HealthStub(auth_server.channel())
    request = health_pb2.HealthCheckRequest(service="megascore.v1.Scorer")
    assert health_stub.Check(request, timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(auth_server.channel())
    listed = list(
        reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
    )
    assert listed[0].list_services_response.service
    counter = auth_server.handles.metrics.requests
    assert counter.labels(front="grpc", rpc="Score", code="UNAUTHENTICATED")._value.get() >= 1


def test_auth_comes_before_parsing(auth_server):
    score = auth_server.channel().unary_unary("/megascore.v1.Scorer/Score")  # raw bytes
    error = assert_fails(lambda: score(b"\xff\xff\xff", timeout=5), grpc.StatusCode.UNAUTHENTICATED)
    assert "authorization: Bearer" in error.details()
    good = [("authorization", f"Bearer {TOKEN}")]
    call = lambda: score(b"\xff\xff\xff", timeout=5, metadata=good)  # noqa: E731
    error = assert_fails(call, grpc.StatusCode.INVALID_ARGUMENT)
    assert error.details().startswith("request does not parse as megascore.v1.ScoreRequest")


# ------------------------------------------------------------------- message size


def test_oversized_message_is_resource_exhausted():
    srv = ServerThread(FakeEngine(), max_message_bytes=64 * 1024)
    try:
        n = 20_000  # 160 KB of int64 ids
        big = pb.ScoreRequest(request_id="huge")
        big.token_ids.CopyFrom(pb.Array(dtype=pb.DTYPE_INT64, data=np.zeros(n, "<i8").tobytes()))
        big.lengths.CopyFrom(
            pb.Array(dtype=pb.DTYPE_INT64, data=np.full(100, 200, "<i8").tobytes())
        )
        assert_fails(lambda: srv.stub().Score(big, timeout=10), grpc.StatusCode.RESOURCE_EXHAUSTED)
        check_response(srv.stub().Score(REQ.proto(), timeout=10), REQ)
    finally:
        srv.stop()


def test_exposed_bind_warning(caplog):
    caplog.set_level(logging.WARNING, logger="megascore_server.tls")
    assert warn_if_exposed(GrpcServerConfig(host="0.0.0.0"))
    assert "without TLS or an auth token" in caplog.text
    assert not warn_if_exposed(GrpcServerConfig(host="0.0.0.0", auth_token_file="t"))
    assert not warn_if_exposed(GrpcServerConfig(host="127.0.0.1"))
    assert is_loopback("::1") and is_loopback("localhost") and not is_loopback("10.0.0.1")

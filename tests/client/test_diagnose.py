"""Errors that say what went wrong: a closed port is "connection refused", a client
without TLS (or without a client certificate) against a TLS (mutual-TLS) server gets
a hint about TLS, a wrong routing shape names the sequence's length, and ``megascore
score`` of a missing file names the file before any connection."""

from __future__ import annotations

import socket

import grpc
import numpy as np
import pytest

from megascore_client import InvalidInputError, ScoringClient, ScoringError, TlsConfig
from megascore_client.cli import main
from tests.client.fake_server import FakeServer

pytest.importorskip("cryptography")
from tests.pki import make_pki  # noqa: E402


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed


@pytest.mark.parametrize("retries", [None, True])
def test_closed_port_says_connection_refused(retries):
    target = _closed_port()
    with ScoringClient(target, retries=retries, timeout=1.5) as client:
        with pytest.raises(ScoringError) as info:
            client.model_info()
    assert f"connection refused: nothing listens at {target}" in info.value.details
    assert info.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_health_wait_on_a_closed_port_says_connection_refused(capsys):
    assert main(["health", "--target", _closed_port(), "--wait", "2"]) == 1
    assert "connection refused" in capsys.readouterr().out


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory):
    pem, paths = make_pki(tmp_path_factory.mktemp("pki"))
    creds = grpc.ssl_server_credentials(
        [(pem["server_key"], pem["server_cert"])],
        root_certificates=pem["client_ca"],
        require_client_auth=True,
    )
    with FakeServer(credentials=creds) as srv:
        yield srv, paths


@pytest.mark.parametrize("retries", [None, True])
@pytest.mark.parametrize(
    ("kind", "hint"),
    [
        ("plaintext", "if it uses TLS, connect with TLS"),
        ("no client cert", "if it requires client certificates (mutual TLS), pass one"),
        ("wrong CA", "not signed by a CA this client trusts"),
    ],
)
def test_tls_mismatch_hints(mtls_server, kind, hint, retries):
    srv, paths = mtls_server
    tls = {
        "plaintext": None,
        "no client cert": TlsConfig(root_ca=paths["server_ca"], server_name="localhost"),
        "wrong CA": TlsConfig(root_ca=paths["rogue_ca"], server_name="localhost"),
    }[kind]
    with ScoringClient(srv.target, tls=tls, retries=retries, timeout=2) as client:
        with pytest.raises(ScoringError) as info:
            client.score([[1, 2, 3]])
    assert hint in info.value.details, info.value.details
    good = TlsConfig(
        root_ca=paths["server_ca"],
        client_cert=paths["client_cert"],
        client_key=paths["client_key"],
        server_name="localhost",
    )
    with ScoringClient(srv.target, tls=good, timeout=5) as client:
        assert client.score([[1, 2, 3]]).lengths.tolist() == [3]


def test_cli_tls_hint(mtls_server, capsys):
    srv, _ = mtls_server
    assert main(["info", "--target", srv.target, "--timeout", "2"]) == 1
    assert "--tls / --root-ca" in capsys.readouterr().err


def test_score_missing_file_is_reported_before_connecting(tmp_path, capsys):
    missing = tmp_path / "missing.jsonl"
    out = str(tmp_path / "out.jsonl")
    assert main(["score", str(missing), "-o", out, "--target", _closed_port()]) == 2
    err = capsys.readouterr().err
    assert f"input {missing}: no such file" in err and "UNAVAILABLE" not in err


def test_routing_shape_message_names_the_sequence_length():
    with ScoringClient(_closed_port(), max_request_tokens=None) as client:
        with pytest.raises(InvalidInputError) as info:
            client.score([[1, 2, 3, 4, 5, 6]], routing=[np.zeros((5, 2, 2), np.int64)])
        assert "routing[0]: 5 rows for sequence 0 of 6 tokens" in info.value.details
        assert "like routing[0]" not in info.value.details
        with pytest.raises(InvalidInputError) as info:
            client.score(
                [[1, 2], [3, 4]],
                routing=[np.zeros((2, 2, 2), np.int64), np.zeros((2, 3, 2), np.int64)],
            )
        assert "routing[1]: (num_moe_layers, topk) = (3, 2) differs from routing[0]'s (2, 2)" in (
            info.value.details
        )

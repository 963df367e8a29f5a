"""TLS and mutual TLS against a real server with a throwaway CA (``cryptography``)."""

from __future__ import annotations

import datetime

import grpc
import pytest

from megascore_client import ScoringClient, ScoringError, TlsConfig
from tests.client.fake_server import FakeServer

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

SERVER_NAME = "megascore.test"


def _issue(name: str, issuer_key, issuer_name, *, ca: bool = False, san: str | None = None):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False
        )
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return key, cert, key_pem, cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert, _, ca_pem = _issue("test-ca", None, None, ca=True)
    _, _, server_key, server_pem = _issue(SERVER_NAME, ca_key, ca_cert.subject, san=SERVER_NAME)
    _, _, client_key, client_pem = _issue("trainer", ca_key, ca_cert.subject)
    files = {
        "ca": ca_pem,
        "server.key": server_key,
        "server.pem": server_pem,
        "client.key": client_key,
        "client.pem": client_pem,
    }
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root, files


def test_tls_with_custom_ca_and_server_name(pki):
    root, files = pki
    creds = grpc.ssl_server_credentials([(files["server.key"], files["server.pem"])])
    with FakeServer(credentials=creds) as srv:
        tls = TlsConfig(root_ca=root / "ca", server_name=SERVER_NAME)
        with ScoringClient(srv.target, tls=tls, timeout=5) as client:
            assert client.score([[1, 2, 3]]).lengths.tolist() == [3]
            assert client.health().serving
        with ScoringClient(srv.target, retries=None, timeout=2) as plaintext:
            with pytest.raises(ScoringError) as info:
                plaintext.score([[1, 2, 3]])
            assert info.value.code is grpc.StatusCode.UNAVAILABLE


def test_mutual_tls(pki):
    root, files = pki
    creds = grpc.ssl_server_credentials(
        [(files["server.key"], files["server.pem"])],
        root_certificates=files["ca"],
        require_client_auth=True,
    )
    with FakeServer(credentials=creds) as srv:
        tls = TlsConfig(
            root_ca=root / "ca",
            client_cert=root / "client.pem",
            client_key=root / "client.key",
            server_name=SERVER_NAME,
        )
        with ScoringClient(srv.target, tls=tls, timeout=5) as client:
            assert client.score([[4, 5]]).lengths.tolist() == [2]
        in_memory = TlsConfig(
            root_ca=files["ca"],
            client_cert=files["client.pem"],
            client_key=files["client.key"],
            server_name=SERVER_NAME,
        )
        with ScoringClient(srv.target, tls=in_memory, timeout=5) as client:
            assert client.health().serving
        no_cert = TlsConfig(root_ca=root / "ca", server_name=SERVER_NAME)
        with ScoringClient(srv.target, tls=no_cert, retries=None, timeout=2) as client:
            with pytest.raises(ScoringError) as info:
                client.score([[4, 5]])
            assert info.value.code is grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ValueError):
        TlsConfig(client_cert=root / "client.pem")

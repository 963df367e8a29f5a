"""A throwaway PKI for the TLS tests (ECDSA P-256, valid for a day).

Three CAs, each with one leaf certificate for ``localhost`` / ``127.0.0.1``: ``server``
(the server's chain), ``client`` (the CA the server trusts for mTLS, and a client
certificate it signed) and ``rogue`` (an unrelated CA and a client certificate).
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

ROLES = ("server", "client", "rogue")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_pki(directory: Path) -> tuple[dict[str, bytes], dict[str, str]]:
    """Writes ``{role}_ca.pem``, ``{role}_cert.pem`` and ``{role}_key.pem`` for each role.

    Returns:
        ``(pem, paths)``: the PEM bytes and the file path of each, by name
        (``"server_ca"``, ``"client_key"``, ...).
    """
    pem: dict[str, bytes] = {}
    for role in ROLES:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _cert(f"{role} CA", ca_key, f"{role} CA", ca_key, ca=True)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert("localhost", key, f"{role} CA", ca_key, ca=False)
        pem[f"{role}_ca"] = ca.public_bytes(serialization.Encoding.PEM)
        pem[f"{role}_cert"] = cert.public_bytes(serialization.Encoding.PEM)
        pem[f"{role}_key"] = _pem_key(key)
    paths = {}
    for name, data in pem.items():
        paths[name] = str(Path(directory) / f"{name}.pem")
        Path(paths[name]).write_bytes(data)
    return pem, paths

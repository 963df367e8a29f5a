"""TLS / mTLS server credentials and the exposed-without-protection warning."""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path

import grpc

from megascore_server.config import GrpcServerConfig

logger = logging.getLogger(__name__)


def _read_pem(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc.strerror or exc}") from exc
    if b"-----BEGIN" not in data:
        raise ValueError(f"{what}: {path} is not a PEM file")
    return data


def server_credentials(config: GrpcServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the configured files, or None for plaintext.

    With ``tls_client_ca`` set, clients must present a certificate signed by that
    CA (mutual TLS).

    Raises:
        ValueError: a file is missing or not PEM.
    """
    if not config.tls_enabled:
        return None
    cert = _read_pem(config.tls_cert, "tls_cert")
    key = _read_pem(config.tls_key, "tls_key")
    client_ca = None
    if config.tls_client_ca is not None:
        client_ca = _read_pem(config.tls_client_ca, "tls_client_ca")
    logger.info("TLS enabled%s", " with client certificates (mTLS)" if client_ca else "")
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts local connections."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(config: GrpcServerConfig) -> bool:
    """Logs a warning when binding beyond loopback without TLS or a token.

    Returns:
        True when the warning was logged.
    """
    if is_loopback(config.host) or config.tls_enabled or config.auth_token_file:
        return False
    logger.warning(
        "binding %s:%d without TLS or an auth token: anyone who can reach it can score "
        "and load weights; set tls_cert/tls_key and/or auth_token_file",
        config.host,
        config.port,
    )
    return True

"""Says why a server cannot be reached, in the error a failed call raises.

gRPC reports a connection that never came up as ``UNAVAILABLE ... Socket closed``
(a plaintext client against a TLS server, a client without a certificate against
a mutual-TLS server) or, once its retries ran out of time, as a bare
``DEADLINE_EXCEEDED: Deadline Exceeded`` (also for a port nobody listens on).
:func:`explain` adds what the connection error means and how to fix it; a bare
deadline is first explained by one quick probe of the server (a health check
without retries) that reports the connection's own error.
"""

from __future__ import annotations

import dataclasses

import grpc

from megascore_client import health as health_codec
from megascore_client.channel import ChannelSettings
from megascore_client.errors import ScoringError

__all__ = ["explain", "probe_connection"]

PROBE_TIMEOUT_S = 1.0
_BARE_DEADLINE = "Deadline Exceeded"  # grpc's own text for a client-side deadline


def probe_connection(settings: ChannelSettings, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """The connection error of a fresh channel to the server (one health check, no
    retries), or None when the server answers (whatever it answers)."""
    channel = dataclasses.replace(settings, retries=None).open_sync()
    try:
        check = health_codec.check_callable(channel)
        check(health_codec.encode_request(""), timeout=timeout, metadata=settings.metadata())
    except grpc.RpcError as exc:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return exc.details()
    finally:
        channel.close()
    return None


def _hint(details: str, settings: ChannelSettings) -> str | None:
    tls = settings.tls
    if "Connection refused" in details:
        return (
            f"connection refused: nothing listens at {settings.target} (is the server "
            "running, and is the target right?)"
        )
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return (
            "the server's certificate is not signed by a CA this client trusts: pass the CA "
            "that signed it (SDK TlsConfig(root_ca=...), CLI --root-ca)"
        )
    if "Socket closed" in details or "handshake" in details.lower():
        if tls is None:
            return (
                "the server closed the connection: if it uses TLS, connect with TLS "
                "(SDK tls=TlsConfig(root_ca=...) or tls=True, CLI --tls / --root-ca)"
            )
        if tls.client_cert is None:
            return (
                "the server closed the TLS connection: if it requires client certificates "
                "(mutual TLS), pass one (SDK TlsConfig(client_cert=..., client_key=...), "
                "CLI --client-cert / --client-key)"
            )
    return None


def explain(error: ScoringError, settings: ChannelSettings) -> ScoringError:
    """``error`` with what its connection failure means, or ``error`` itself.

    Args:
        error: the error of a call.
        settings: the client's channel settings (target, TLS).

    Returns:
        A ScoringError with the same code and sequence offset and longer details, when
        the failure is a connection that never came up; else ``error``.
    """
    code, details = error.code, error.details
    cause = details
    if code is grpc.StatusCode.DEADLINE_EXCEEDED and details == _BARE_DEADLINE:
        cause = probe_connection(settings)
        if cause is None:  # the server answers: a slow call, nothing to add
            return error
    elif code is not grpc.StatusCode.UNAVAILABLE:
        return error
    hint = _hint(cause, settings)
    if hint is None and cause == details:
        return error
    said = details if cause == details else f"{details}; a probe: {cause}"
    text = f"{hint or 'the server cannot be reached'} (gRPC: {said})"
    return ScoringError(code, text, error.sequence_offset)

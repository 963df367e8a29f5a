"""Channel construction shared by the sync and asyncio clients.

Everything a channel needs (credentials, message-size limits, keepalive, the retry
policy and the load-balancing policy) is computed once into :class:`ChannelSettings`;
the clients only differ in which ``grpc`` module opens the channel.

Retries are gRPC's own (``grpc.enable_retries`` + a ``retryPolicy`` in the
``grpc.service_config`` JSON): UNAVAILABLE and CANCELLED are retried, with exponential
backoff, and only the unary calls that read (:data:`RETRIED_METHODS`: Score, model info, health);
LoadWeights, UpdateWeights and FinishWeightUpdate change the served weights and go out
once (a push that fails UNAVAILABLE is the caller's to repeat, from its start).
CANCELLED is retried because a server that stops cancels, in grpc core, every call that
reaches it after its shutdown began and before the client read its GOAWAY (status
CANCELLED, details "CANCELLED"; no handler runs, so the server cannot answer it
otherwise: docs/reliability.md "Drain"). Scoring is idempotent, so such a call is sent
again. gRPC never retries a call its caller cancelled (``future.cancel()``, a closed
channel) nor one past its own deadline (DEADLINE_EXCEEDED).
Each delay is the current backoff +-20 % (gRPC core's retry code jitters its backoff by
0.2, ``RetryFilter::BackoffJitter()``; the ``[0, backoff]`` draw of the retry design
doc, gRFC A6, is not what grpcio 1.85 does): the backoff starts at
``initial_backoff_s`` and is multiplied after each retry up to ``max_backoff_s``, so
the default policy spends 0.2 + 0.4 + 0.8 + 1.6 = 3.0 s (2.4-3.6 s) between its 5
attempts. gRPC caps ``maxAttempts`` at 5; riding out a longer outage (a server
restart) is the clients' ``wait_for_server_s`` (:mod:`megascore_client.waiting`).
Requests up to ``max_message_bytes`` stay retryable because the per-call retry buffer
is raised to that size (its 256 KiB default would silently commit larger calls to
their first attempt).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import grpc

from megascore import __version__

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "ChannelSettings",
    "RetryPolicy",
    "TlsConfig",
    "resolve_retries",
]

SCORER_SERVICE = "megascore.v1.Scorer"
HEALTH_SERVICE = "grpc.health.v1.Health"
RETRIED_METHODS = ("Score", "GetModelInfo")
"""The Scorer methods gRPC retries (they read; the weight-changing ones are not retried).
ScoreStream is not one of them: gRPC's replay of a bidi stream whose first attempt was
refused lost one pipelined message in the 60-minute soak (docs/reliability.md); a
failed stream fails its outstanding futures instead (:mod:`megascore_client.stream`)."""
RETRIED_CODES = ("UNAVAILABLE", "CANCELLED")
"""The status codes gRPC retries (CANCELLED only when the server or the connection
ended the call: gRPC does not retry its caller's own cancellation)."""
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
_LB_POLICIES = ("pick_first", "round_robin")


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    """TLS settings. Each PEM field is a file path or the PEM ``bytes`` themselves.

    Attributes:
        root_ca: CA bundle that signed the server certificate (None = system roots).
        client_cert: client certificate chain for mutual TLS (needs ``client_key``).
        client_key: private key of ``client_cert``.
        server_name: name to verify the server certificate against when it differs
            from the target host (e.g. connecting by IP to a cert issued for a DNS name).
    """

    root_ca: str | os.PathLike | bytes | None = None
    client_cert: str | os.PathLike | bytes | None = None
    client_key: str | os.PathLike | bytes | None = None
    server_name: str | None = None

    def __post_init__(self):
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert and client_key must be given together")

    def credentials(self) -> grpc.ChannelCredentials:
        """Reads the PEM files and builds ``grpc.ssl_channel_credentials``."""

        def read(source):
            if source is None or isinstance(source, bytes):
                return source
            return Path(source).read_bytes()

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.root_ca),
            private_key=read(self.client_key),
            certificate_chain=read(self.client_cert),
        )


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """gRPC retry policy applied to UNAVAILABLE and to CANCELLED by the server (see the
    module doc).

    The n-th retry waits ``min(initial_backoff_s * backoff_multiplier**(n-1),
    max_backoff_s)`` +-20 % (gRPC's jitter).

    Attributes:
        max_attempts: total attempts including the first, 2..5 (gRPC's cap).
        initial_backoff_s: backoff before the first retry.
        max_backoff_s: upper bound of the backoff.
        backoff_multiplier: growth factor of the backoff per attempt.
    """

    max_attempts: int = 5
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    backoff_multiplier: float = 2.0

    def __post_init__(self):
        if not 2 <= self.max_attempts <= 5:
            raise ValueError(
                f"max_attempts must be in [2, 5] (gRPC caps it), not {self.max_attempts}"
            )
        if not (self.initial_backoff_s > 0 and self.max_backoff_s >= self.initial_backoff_s):
            raise ValueError("need 0 < initial_backoff_s <= max_backoff_s")
        if not self.backoff_multiplier > 0:
            raise ValueError("backoff_multiplier must be > 0")

    def to_json(self) -> dict:
        """The ``retryPolicy`` object of a gRPC service config."""
        return {
            "maxAttempts": self.max_attempts,
            "initialBackoff": f"{self.initial_backoff_s:.3f}s",
            "maxBackoff": f"{self.max_backoff_s:.3f}s",
            "backoffMultiplier": self.backoff_multiplier,
            "retryableStatusCodes": list(RETRIED_CODES),
        }


def resolve_retries(retries: RetryPolicy | int | bool | None) -> RetryPolicy | None:
    """Normalises the ``retries`` argument of the clients.

    Args:
        retries: a :class:`RetryPolicy`; an int = number of retries after the first
            attempt (0 disables, at most 4); True = the default policy; None/False =
            no retries.

    Returns:
        The policy, or None when retries are off.
    """
    if retries is None or retries is False:
        return None
    if retries is True:
        return RetryPolicy()
    if isinstance(retries, RetryPolicy):
        return retries
    if isinstance(retries, int):
        return None if retries == 0 else RetryPolicy(max_attempts=retries + 1)
    raise TypeError(f"retries must be a RetryPolicy, an int or None, got {type(retries)}")


@dataclasses.dataclass(frozen=True)
class ChannelSettings:
    """Resolved options of one client (see ``ScoringClient`` for the meaning of each)."""

    target: str
    tls: TlsConfig | None = None
    token: str | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    retries: RetryPolicy | None = dataclasses.field(default_factory=RetryPolicy)
    load_balancing: str | None = None
    keepalive_time_s: float | None = 300.0
    keepalive_timeout_s: float = 20.0

    def __post_init__(self):
        if not self.target:
            raise ValueError("target must be a non-empty gRPC target, e.g. '127.0.0.1:50051'")
        if self.max_message_bytes < 64 * 1024:
            raise ValueError(f"max_message_bytes must be >= 65536, got {self.max_message_bytes}")
        if self.load_balancing is not None and self.load_balancing not in _LB_POLICIES:
            raise ValueError(f"load_balancing must be one of {_LB_POLICIES} or None")
        if self.keepalive_time_s is not None and not self.keepalive_time_s > 0:
            raise ValueError("keepalive_time_s must be > 0 or None")

    @classmethod
    def build(cls, target: str, *, tls: TlsConfig | bool | None, retries, **kwargs):
        """Builds settings from the client keyword arguments (``tls=True`` = system roots)."""
        if tls is True:
            tls = TlsConfig()
        elif tls is False:
            tls = None
        return cls(target=target, tls=tls, retries=resolve_retries(retries), **kwargs)

    def service_config(self) -> dict:
        """The ``grpc.service_config`` JSON object: retry policy and LB policy."""
        config: dict = {}
        if self.retries is not None:
            config["methodConfig"] = [
                {
                    "name": [
                        *({"service": SCORER_SERVICE, "method": m} for m in RETRIED_METHODS),
                        {"service": HEALTH_SERVICE},
                    ],
                    "retryPolicy": self.retries.to_json(),
                }
            ]
        if self.load_balancing is not None:
            config["loadBalancingConfig"] = [{self.load_balancing: {}}]
        return config

    def options(self) -> list[tuple[str, object]]:
        """Channel arguments (``grpc.*`` options) for ``insecure_channel``/``secure_channel``."""
        retry_buffer = self.max_message_bytes + 64 * 1024
        opts: list[tuple[str, object]] = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.enable_retries", 1 if self.retries is not None else 0),
            ("grpc.per_rpc_retry_buffer_size", retry_buffer),
            ("grpc.retry_buffer_size", max(256 * 1024 * 1024, 4 * retry_buffer)),
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 5000),
            ("grpc.primary_user_agent", f"megascore-client/{__version__}"),
        ]
        service_config = self.service_config()
        if service_config:
            opts.append(("grpc.service_config", json.dumps(service_config)))
        if self.keepalive_time_s is not None:
            opts += [
                ("grpc.keepalive_time_ms", math.ceil(self.keepalive_time_s * 1000)),
                ("grpc.keepalive_timeout_ms", math.ceil(self.keepalive_timeout_s * 1000)),
                ("grpc.keepalive_permit_without_calls", 0),
                ("grpc.http2.max_pings_without_data", 0),
            ]
        if self.tls is not None and self.tls.server_name:
            opts.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return opts

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: ``authorization: Bearer <token>`` when a token is set."""
        if self.token:
            return (("authorization", f"Bearer {self.token}"),)
        return ()

    def open_sync(self) -> grpc.Channel:
        """Opens a ``grpc.Channel``."""
        if self.tls is None:
            return grpc.insecure_channel(self.target, options=self.options())
        return grpc.secure_channel(self.target, self.tls.credentials(), options=self.options())

    def open_aio(self) -> grpc.aio.Channel:
        """Opens a ``grpc.aio.Channel`` (call from inside the event loop that will use it)."""
        if self.tls is None:
            return grpc.aio.insecure_channel(self.target, options=self.options())
        return grpc.aio.secure_channel(self.target, self.tls.credentials(), options=self.options())

"""Server configuration dataclasses (torch-free).

:class:`GrpcServerConfig` describes the gRPC front end of rank 0 (address, limits,
batching, security, metrics); :class:`ReplicaConfig` combines it with the
:class:`megascore.config.EngineConfig` every rank builds its engine from and
the number of local ranks. Parsing (CLI flags, YAML / TOML files, environment
variables) lives in :mod:`megascore_server.config_loader`.
"""

from __future__ import annotations

import dataclasses
import logging

from megascore.config import EngineConfig

logger = logging.getLogger(__name__)

MIB = 1024 * 1024


@dataclasses.dataclass
class GrpcServerConfig:
    """The servers of rank 0 (gRPC, and the HTTP front when ``http_port`` is set):
    address, limits, batching, security, metrics, tokenizer."""

    host: str = "127.0.0.1"
    """Address to bind. A non-loopback address without TLS or a token logs a warning."""
    port: int = 50051
    """gRPC port; 0 picks a free port (the log line "Scorer bound on" names it)."""
    http_port: int = 0
    """Port of the HTTP front (OpenAI/vLLM ``/v1/completions``, SGLang ``/generate``,
    docs/http.md) on ``host``, beside gRPC in the same process; 0 = off. Same limits,
    token and TLS as gRPC."""
    tokenizer: str | None = None
    """Local tokenizer directory for text prompts and token strings; unset = an
    ``hf:DIR`` checkpoint's own tokenizer when it has one (built-ins have none)."""
    max_tokens_per_batch: int = 16384
    """Budget of one engine step: its padded rows (a shared prompt counted once when
    the engine shares prefixes; ``megascore_server.shared_units``)."""
    max_batch_wait_ms: float = 2.0
    """Longest wait for more requests before launching a step that is not full."""
    max_queue: int = 1024
    """Most requests waiting for the engine; more are rejected with RESOURCE_EXHAUSTED."""
    max_queue_tokens: int = 0
    """Most tokens waiting for the engine (0 = bounded only by ``max_queue``)."""
    max_sequence_length: int | None = None
    """Longest sequence accepted; unset = the model's maximum (never above it)."""
    max_request_tokens: int = 1 << 20
    """Most tokens in one request; more is RESOURCE_EXHAUSTED."""
    max_message_bytes: int = 256 * MIB
    """Largest gRPC message sent or received."""
    max_stream_inflight: int = 32
    """Requests of one ScoreStream submitted ahead of their responses (back-pressure)."""
    max_concurrent_streams: int = 128
    """Calls open at once on one gRPC connection (HTTP/2 ``MAX_CONCURRENT_STREAMS``);
    a client's further calls wait on its side."""
    max_connections: int = 0
    """Connections each front (gRPC, HTTP) keeps open at once; beyond, a new one is
    closed at once (HTTP: answered 503 first). 0 = a third of the open-files limit
    (``megascore_server.connection_limits``)."""
    header_timeout_s: float = 10.0
    """Time a connection has to send a whole HTTP request head (of opening, or of its
    previous answer's end) or to finish its gRPC handshake; else it is closed."""
    tls_cert: str | None = None
    """PEM server certificate chain; enables TLS together with ``tls_key``."""
    tls_key: str | None = None
    """PEM private key of ``tls_cert``."""
    tls_client_ca: str | None = None
    """PEM CA bundle; when set, clients must present a certificate it signed (mTLS)."""
    auth_token_file: str | None = None
    """File holding the bearer token clients must send (``authorization: Bearer <token>``)."""
    metrics_port: int = 0
    """Port of the Prometheus HTTP endpoint (0 = off); bound on ``host``."""
    grace_s: float = 30.0
    """On shutdown, time given to in-flight requests before they are cancelled."""
    log_level: str = "INFO"
    """Python logging level of the server process."""

    def __post_init__(self):
        if not self.host:
            raise ValueError("host must not be empty")
        for name in ("port", "metrics_port", "http_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {value}")
        for name in (
            "max_tokens_per_batch",
            "max_queue",
            "max_request_tokens",
            "max_stream_inflight",
            "max_concurrent_streams",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.http_port and self.http_port in (self.port, self.metrics_port):
            raise ValueError(f"http_port {self.http_port} is also the gRPC or metrics port")
        if self.max_queue_tokens < 0:
            raise ValueError(f"max_queue_tokens must be >= 0, got {self.max_queue_tokens}")
        if 0 < self.max_queue_tokens < self.max_request_tokens:
            raise ValueError(
                f"max_queue_tokens {self.max_queue_tokens} must be 0 or >= max_request_tokens "
                f"{self.max_request_tokens} (a largest request must fit an empty queue)"
            )
        if self.max_sequence_length is not None and self.max_sequence_length < 1:
            raise ValueError(
                f"max_sequence_length must be >= 1 or None, got {self.max_sequence_length}"
            )
        if self.max_connections < 0:
            raise ValueError(f"max_connections must be >= 0, got {self.max_connections}")
        if self.header_timeout_s <= 0:
            raise ValueError(f"header_timeout_s must be > 0, got {self.header_timeout_s}")
        if self.max_batch_wait_ms < 0:
            raise ValueError(f"max_batch_wait_ms must be >= 0, got {self.max_batch_wait_ms}")
        if self.max_message_bytes < 4096:
            raise ValueError(f"max_message_bytes must be >= 4096, got {self.max_message_bytes}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
        if self.log_level.upper() not in logging.getLevelNamesMapping():
            raise ValueError(f"log_level must be a logging level name, got {self.log_level!r}")

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert is not None


@dataclasses.dataclass
class ReplicaConfig:
    """Everything ``megascore serve`` needs: server, engine and the local rank count."""

    server: GrpcServerConfig = dataclasses.field(default_factory=GrpcServerConfig)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    nproc: int = 1
    """Local ranks to launch (1 = this process only; ignored under torchrun)."""

    def __post_init__(self):
        if self.nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {self.nproc}")

    def to_dict(self) -> dict:
        """Plain nested dict (``server``, ``engine``, ``nproc``) for logging / files."""
        return {
            "server": dataclasses.asdict(self.server),
            "engine": dataclasses.asdict(self.engine),
            "nproc": self.nproc,
        }

    @classmethod
    def from_dict(cls, data: dict) -> ReplicaConfig:
        """Inverse of :meth:`to_dict`; validates every field."""
        return cls(
            server=GrpcServerConfig(**data.get("server", {})),
            engine=EngineConfig(**data.get("engine", {})),
            nproc=int(data.get("nproc", 1)),
        )

    def log_resolved(self) -> None:
        """Logs the resolved configuration once (the token file path, never the token)."""
        logger.info("resolved config: %s", self.to_dict())

"""Bearer-token authentication: a ``grpc.aio`` server interceptor.

Clients send ``authorization: Bearer <token>`` metadata; anything else raises
:class:`UnauthenticatedError` on every RPC (UNAUTHENTICATED through the status
table, :mod:`megascore_server.status`). Health checking and server reflection
stay reachable without a token (load balancers and ``grpcurl`` need them).
The token is read from a file so that it never appears in a command line.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from megascore.api.errors import UnauthenticatedError

OPEN_SERVICES = (
    health.SERVICE_NAME,
    reflection.SERVICE_NAME,  # grpc.reflection.v1alpha.ServerReflection
    "grpc.reflection.v1.ServerReflection",
)


def read_token(path: str | Path) -> str:
    """Reads the bearer token (surrounding whitespace stripped) from ``path``.

    Raises:
        ValueError: the file is empty.
        OSError: the file cannot be read.
    """
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"auth token file {path} is empty")
    if any(c.isspace() for c in token):
        raise ValueError(f"auth token in {path} must not contain whitespace")
    return token


def _service_of(method: str) -> str:
    """``/pkg.Service/Method`` -> ``pkg.Service``."""
    return method.lstrip("/").split("/", 1)[0]


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without ``authorization: Bearer <token>`` (except open services).

    Place it after :class:`megascore_server.status.StatusInterceptor`, which answers,
    logs and counts the rejections.

    Args:
        token: the expected token.
    """

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def _authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(got, self._expected)
        return False

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if _service_of(method) in OPEN_SERVICES or self._authorized(
            handler_call_details.invocation_metadata
        ):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return _deny(handler)


async def _refuse(request_or_iterator, context: grpc.aio.ServicerContext):
    raise UnauthenticatedError(
        "missing or invalid credentials: send metadata 'authorization: Bearer <token>'"
    )


def _unread(data: bytes) -> None:
    """The request of a refused call is not parsed: it is refused whatever its bytes."""
    return None


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that raises :class:`UnauthenticatedError`."""
    kwargs = {
        "request_deserializer": _unread,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse, **kwargs)
    return grpc.unary_unary_rpc_method_handler(_refuse, **kwargs)

"""The one table mapping exception types to gRPC status codes.

Typed errors (:mod:`megascore.errors`) carry a reason that is safe to show
the caller; anything else is a bug or an engine failure and is answered with
INTERNAL and a generic message, the traceback going to the log only.
"""

from __future__ import annotations

import logging

import grpc

from megascore.errors import (
    CheckpointError,
    InvalidRequestError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)

logger = logging.getLogger(__name__)

# Order matters: the first matching entry wins (subclasses before their bases).
STATUS_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),  # includes WorkerLostError
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (CheckpointError, grpc.StatusCode.FAILED_PRECONDITION),
)

INTERNAL_MESSAGE = "internal error (see the server log)"


def status_for(exc: BaseException, request_id: str = "") -> tuple[grpc.StatusCode, str]:
    """Maps an exception to the gRPC status code and message sent to the caller.

    Unmapped exceptions become INTERNAL with a generic message; their traceback
    is logged here, with the request id.

    Args:
        exc: the exception raised while handling a request.
        request_id: id for the log line (and the message, when not empty).

    Returns:
        ``(code, message)``.
    """
    prefix = f"request_id={request_id}: " if request_id else ""
    for exc_type, code in STATUS_TABLE:
        if isinstance(exc, exc_type):
            reason = getattr(exc, "reason", str(exc))
            return code, prefix + reason
    logger.error(
        "request_id=%s: unexpected %s", request_id or "-", type(exc).__name__, exc_info=exc
    )
    return grpc.StatusCode.INTERNAL, prefix + INTERNAL_MESSAGE

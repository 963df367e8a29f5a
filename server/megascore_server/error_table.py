"""The one table from a typed error (:mod:`megascore.api.errors`) to every front's status.

gRPC answers with the code (:mod:`megascore_server.status`), HTTP with the status
(:mod:`megascore_server.http.errors`); the reason the error carries is safe to show
the caller on both. Anything not in the table is a bug or an engine failure:
INTERNAL / 500 with a generic message and the traceback in the log.
"""

from __future__ import annotations

import dataclasses

import grpc

from megascore.api.errors import (
    CheckpointError,
    ConflictError,
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    RequestTooLargeError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)


@dataclasses.dataclass(frozen=True)
class Mapping:
    """How the fronts answer one error type.

    Attributes:
        error: the exception type (subclasses included).
        grpc_code: the gRPC status code.
        http_status: the HTTP status.
        http_type: OpenAI's ``error.type`` of that HTTP answer.
    """

    error: type[BaseException]
    grpc_code: grpc.StatusCode
    http_status: int
    http_type: str


# Order matters: the first matching entry wins (subclasses before their bases).
ERROR_TABLE: tuple[Mapping, ...] = (
    Mapping(InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    Mapping(RequestTooLargeError, grpc.StatusCode.RESOURCE_EXHAUSTED, 413, "invalid_request_error"),
    Mapping(ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    Mapping(UnavailableError, grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable"),  # + lost
    Mapping(UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
    Mapping(CheckpointError, grpc.StatusCode.FAILED_PRECONDITION, 409, "checkpoint_error"),
    Mapping(
        FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION, 412, "precondition_failed"
    ),
    Mapping(ConflictError, grpc.StatusCode.ABORTED, 409, "conflict"),
    Mapping(NotFoundError, grpc.StatusCode.NOT_FOUND, 404, "NotFoundError"),  # vLLM's
)

INTERNAL_MESSAGE = "internal error (see the server log)"


def mapping_for(exc: BaseException) -> Mapping | None:
    """The table's entry for ``exc`` (None: not a typed error: INTERNAL / 500)."""
    for entry in ERROR_TABLE:
        if isinstance(exc, entry.error):
            return entry
    return None

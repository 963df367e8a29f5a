"""Typed errors. The gRPC layer maps each type to one status code (server/.../status.py)."""

from __future__ import annotations

QUOTE_CHARS = 64
"""User data quoted in a message: at most this many characters, then the full length."""


def clip(text: str, limit: int = QUOTE_CHARS) -> str:
    """``text`` itself when short, else its first ``limit`` characters and its length."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def quoted(text: str, limit: int = QUOTE_CHARS) -> str:
    """``repr(text)`` when short, else the repr of its first ``limit`` characters and its
    length: user data in an error message."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


class MegascoreError(Exception):
    """Base class: carries a human-readable reason."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class InvalidRequestError(MegascoreError):
    """The request is malformed (-> INVALID_ARGUMENT). Names the field and sequence."""


class ResourceExhaustedError(MegascoreError):
    """Too large, or the queue is full (-> RESOURCE_EXHAUSTED; HTTP 429, retry later)."""


class RequestTooLargeError(ResourceExhaustedError):
    """One request over a size limit (-> RESOURCE_EXHAUSTED; HTTP 413: split it, a retry
    as it is fails again)."""


class UnavailableError(MegascoreError):
    """Not ready, draining, or a rank was lost (-> UNAVAILABLE)."""


class UnauthenticatedError(MegascoreError):
    """Missing or wrong credentials (-> UNAUTHENTICATED)."""


class WorkerLostError(UnavailableError):
    """A worker rank died or timed out in a collective; the replica must restart."""


class ConflictError(MegascoreError):
    """Another operation holds what the request needs, e.g. a second concurrent weight
    push (-> ABORTED: retry once the other finished)."""


class FailedPreconditionError(MegascoreError):
    """The replica is not in the state the request needs (-> FAILED_PRECONDITION)."""


class WrongVersionError(FailedPreconditionError):
    """A request pinned to a weights version reached a replica serving another one
    (-> FAILED_PRECONDITION: another replica, or this one after its next swap, may
    serve it)."""


class NotFoundError(MegascoreError):
    """A name the request gives (a model: weight set or adapter) is not served here
    (-> NOT_FOUND; HTTP 404, as vLLM answers an unknown model)."""


class CheckpointError(MegascoreError):
    """A checkpoint is missing, corrupt or does not match the model (names the tensor)."""


LOAD_FAILURES: tuple[type[Exception], ...] = (ValueError, CheckpointError)
"""A model that cannot load for a stated reason (bad model string or path, unsupported
or other architecture, damaged checkpoint): the message says it all, so it is logged
as one line without a traceback. Anything else while loading is unexpected: traceback."""

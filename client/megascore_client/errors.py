"""The one SDK exception: :class:`ScoringError`, carrying the gRPC status code and details.

Every ``grpc.RpcError`` raised by a call (sync or asyncio) is converted with
:func:`ScoringError.from_rpc_error`; input the client rejects before sending raises
:class:`InvalidInputError`, which is both a ``ScoringError`` (code INVALID_ARGUMENT,
as the server would answer) and a ``ValueError``.
"""

from __future__ import annotations

import re

import grpc

__all__ = ["InvalidInputError", "ScoringError", "closed_error", "malformed_response"]

# How the server ("sequence 4", "sequences[4]") and the client ("sequences[4]",
# "loss_mask[4]", "lengths[4]") name a sequence of a request in an error message.
_SEQUENCE_REF = re.compile(r"\bsequences?(?: |\[)(\d+)|\b(?:loss_mask|lengths)\[(\d+)\]")


class ScoringError(Exception):
    """A failed megascore call.

    Attributes:
        code: the ``grpc.StatusCode`` of the failure (the server's, or the one the
            client assigned to a local failure).
        details: the status message (the server names the offending field and
            sequence index for INVALID_ARGUMENT).
        sequence_offset: for a batch the client split into several requests, the index
            in the call's batch of the first sequence of the request that failed (the
            sequence indices in ``details`` count from it); 0 otherwise.
    """

    def __init__(self, code: grpc.StatusCode, details: str, sequence_offset: int = 0):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.sequence_offset = sequence_offset

    @property
    def sequence_index(self) -> int | None:
        """Index in the call's batch of the sequence that ``details`` names (the first
        one), or None when it names none."""
        match = _SEQUENCE_REF.search(self.details)
        if match is None:
            return None
        return self.sequence_offset + int(match.group(1) or match.group(2))

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> ScoringError:
        """Converts a ``grpc.RpcError`` (sync or ``grpc.aio``) into a ``ScoringError``.

        Args:
            error: the error raised by a stub call or a call future.

        Returns:
            A ``ScoringError`` with the call's status code and details; UNKNOWN when the
            error carries no status (should not happen for real calls).
        """
        code = error.code() if callable(getattr(error, "code", None)) else None
        details = error.details() if callable(getattr(error, "details", None)) else None
        if not isinstance(code, grpc.StatusCode):
            code = grpc.StatusCode.UNKNOWN
        return cls(code, details or str(error) or code.name)

    @property
    def retryable(self) -> bool:
        """True for UNAVAILABLE: the only code the SDK retries (gRPC's retry policy,
        then the re-sends of ``wait_for_server_s``)."""
        return self.code is grpc.StatusCode.UNAVAILABLE

    def __reduce__(self):
        return (type(self), (self.code, self.details, self.sequence_offset))


class InvalidInputError(ScoringError, ValueError):
    """Input rejected by the client before any call (code INVALID_ARGUMENT)."""

    def __init__(self, details: str):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, details)

    def __reduce__(self):
        return (type(self), (self.details,))


def closed_error() -> ScoringError:
    """Raised by a call or stream started on a closed client, by a call in flight that
    ``close()`` cancelled (asyncio client), and by a request waiting for the server (or
    in ``wait_until_serving``) when the client is closed: code CANCELLED."""
    return ScoringError(grpc.StatusCode.CANCELLED, "the client is closed")


def malformed_response(details: str) -> ScoringError:
    """A response that breaks the wire contract (a server bug): code INTERNAL."""
    return ScoringError(grpc.StatusCode.INTERNAL, f"malformed response: {details}")

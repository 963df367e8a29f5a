"""Minimal ``grpc.health.v1.Health/Check`` codec.

The health protocol has two one-field messages (``HealthCheckRequest{string
service = 1}``, ``HealthCheckResponse{ServingStatus status = 1}``). Encoding them by
hand keeps the base client install free of ``grpcio-health-checking`` (a server
dependency); the tests check this codec against a real ``grpc_health`` servicer.
"""

from __future__ import annotations

import grpc

from megascore_client.errors import ScoringError, malformed_response
from megascore_client.results import HealthStatus

__all__ = ["check_callable", "decode_response", "encode_request", "status_after"]

CHECK_METHOD = "/grpc.health.v1.Health/Check"
_STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise malformed_response("truncated varint in HealthCheckResponse")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def encode_request(service: str) -> bytes:
    """Serialises ``HealthCheckRequest(service=service)``."""
    raw = service.encode()
    return b"\x0a" + _varint(len(raw)) + raw if raw else b""


def decode_response(data: bytes) -> HealthStatus:
    """Parses ``HealthCheckResponse`` bytes (unknown fields are skipped)."""
    status, pos = 0, 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _read_varint(data, pos)
            if field == 1:
                status = value
        elif wire_type == 2:
            size, pos = _read_varint(data, pos)
            pos += size
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise malformed_response(f"unsupported wire type {wire_type} in HealthCheckResponse")
    if pos != len(data):
        raise malformed_response("truncated HealthCheckResponse")
    name = _STATUS_NAMES.get(status, "UNKNOWN")
    return HealthStatus(serving=name == "SERVING", status=name)


def _identity(data: bytes) -> bytes:
    return data


def check_callable(channel: grpc.Channel | grpc.aio.Channel):
    """The ``Health/Check`` unary callable of a sync or asyncio channel (bytes in/out)."""
    return channel.unary_unary(
        CHECK_METHOD, request_serializer=_identity, response_deserializer=_identity
    )


def status_after(error: ScoringError) -> HealthStatus:
    """What ``health()`` answers after a failed check: SERVICE_UNKNOWN when the server
    does not know the service (NOT_FOUND); any other error is raised."""
    if error.code is not grpc.StatusCode.NOT_FOUND:
        raise error
    return HealthStatus(serving=False, status="SERVICE_UNKNOWN")

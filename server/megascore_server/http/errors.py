"""HTTP answers of failed calls, in OpenAI's error shape.

``{"error": {"message", "type", "param", "code"}}``: the status and the type come from
the one error table (:mod:`megascore_server.error_table`); ``param`` names the field
at fault in the dialect's own words when the message starts with it.
"""

from __future__ import annotations

import logging

import orjson
from starlette.responses import Response

from megascore.api.errors import InvalidRequestError, clip
from megascore_server.error_table import INTERNAL_MESSAGE, mapping_for

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 1024
RETRY_AFTER_S = 1
"""``Retry-After`` of a 429 (queue full) and a 503 (not serving)."""


class HttpError(InvalidRequestError):
    """A request the front refuses with a given status (e.g. 404, 405, 413).

    Args:
        status: the HTTP status.
        reason: the message.
        param: the field at fault, if any.
    """

    def __init__(self, status: int, reason: str, param: str | None = None):
        super().__init__(reason)
        self.status, self.param = status, param


class DeadlineExceeded(Exception):
    """The request's ``X-Request-Timeout`` passed before it was answered (504)."""


def _scrub(value):
    """``value`` with every string made valid UTF-8 (a lone surrogate a body sent, e.g.
    ``"\\ud800"`` in a key or an id the answer echoes, becomes ``?``)."""
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {_scrub(k): _scrub(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_scrub(v) for v in value]
    return value


def _dumps(body) -> bytes:
    try:
        return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:  # a string that is not valid UTF-8: rare, only then walked
        return orjson.dumps(_scrub(body), option=orjson.OPT_SERIALIZE_NUMPY)


def json_response(body, status: int = 200, headers: dict | None = None) -> Response:
    """``body`` encoded with orjson (numpy arrays as lists, NaN as null; a string that
    is not valid UTF-8 has its lone surrogates replaced)."""
    return Response(
        _dumps(body),
        status_code=status,
        headers=headers,
        media_type="application/json",
    )


def _param(message: str, fields: dict[str, str]) -> str | None:
    """The field a message starts with (``"prompt[2]: ..."`` -> ``prompt[2]``), in the
    dialect's words (``fields`` maps domain names such as ``token_ids`` to them)."""
    head = message.split(":", 1)[0]
    if " " in head or head == message:
        return None
    return fields.get(head, head)


def error_response(exc: BaseException, request_id: str = "", fields=None) -> Response:
    """The answer to ``exc``: its table status and OpenAI's error body (500 with a
    generic message, and the traceback in the log, for anything untyped)."""
    if isinstance(exc, HttpError):
        status, kind = exc.status, "invalid_request_error"
    elif isinstance(exc, DeadlineExceeded):
        status, kind = 504, "timeout"
    else:
        entry = mapping_for(exc)
        if entry is None:
            logger.error(
                "request_id=%s: unexpected %s", request_id or "-", type(exc).__name__, exc_info=exc
            )
            body = {
                "error": {
                    "message": INTERNAL_MESSAGE,
                    "type": "internal_error",
                    "param": None,
                    "code": 500,
                }
            }
            return json_response(body, 500)
        status, kind = entry.http_status, entry.http_type
    reason = getattr(exc, "reason", None) or str(exc) or "request timed out"
    prefix = f"request_id={request_id}: " if request_id else ""
    body = {
        "error": {
            "message": clip(prefix + reason, MAX_MESSAGE_CHARS),
            "type": kind,
            "param": getattr(exc, "param", None) or _param(reason, fields or {}),
            "code": status,
        }
    }
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    if status == 503:  # loading or draining: the client reconnects (after a drain, elsewhere)
        headers["Connection"] = "close"
    return json_response(body, status, headers)

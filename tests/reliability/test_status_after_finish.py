"""Issue 36, item 0: a failed call whose status cannot be sent any more.

``scripts/fuzz.py --seed 4242 --cases 10000`` (TP=2 tiny) once logged a traceback:
``StatusInterceptor._fail`` -> ``context.abort`` raised ``ExecuteBatchError``
(SendInitialMetadata + SendStatusFromServer) for a request with a 1 ms deadline whose
options were refused. The deadline had passed while the handler ran, grpc core had
ended the call, and grpc's own cancellation watcher (``_handle_cancellation_from_core``)
had not yet run: the status could not be sent, and grpc-python logs an error that
escapes a handler with a traceback unless it already knows the client closed.

That ordering is a race inside grpc's completion queue (the usual order cancels the
handler first), so it is reproduced here with the exact error grpc raised, from a
context whose ``abort`` fails as grpc core's did: ``_fail`` must turn it into one
counted log line (``megascore_status_not_sent_total``) and end the call as cancelled
(which grpc ends quietly), never let the error out.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc._cython import cygrpc

from megascore.api.errors import InvalidRequestError
from megascore_server.metrics import ServerMetrics
from megascore_server.status import StatusInterceptor

BATCH_ERROR = (
    'Failed "execute_batch": (<grpc._cython.cygrpc.SendInitialMetadataOperation object>, '
    "<grpc._cython.cygrpc.SendStatusFromServerOperation object>)"
)


class _EndedCall:
    """A servicer context of a call grpc core has ended: abort cannot send."""

    def __init__(self):
        self.aborts = []

    async def abort(self, code, details=""):
        self.aborts.append((code, details))
        raise cygrpc.ExecuteBatchError(BATCH_ERROR)


class _LiveCall(_EndedCall):
    async def abort(self, code, details=""):
        self.aborts.append((code, details))
        raise grpc.aio.AbortError("Locally aborted.")


def _not_sent(metrics: ServerMetrics) -> float | None:
    return metrics.registry.get_sample_value(
        "megascore_status_not_sent_total", {"rpc": "Score", "code": "INVALID_ARGUMENT"}
    )


def _fail(interceptor, context):
    error = InvalidRequestError("options.top_k: 2147483647 is outside [0, max_top_k=256]")
    return asyncio.run(interceptor._fail("Score", True, error, context, 0.0))


def test_a_status_that_cannot_be_sent_is_one_counted_line_not_a_traceback(caplog):
    metrics = ServerMetrics()
    interceptor = StatusInterceptor(metrics)
    caplog.set_level(logging.INFO, logger="megascore_server.status")
    for _ in range(3):
        context = _EndedCall()
        with pytest.raises(asyncio.CancelledError):  # grpc ends such a handler quietly
            _fail(interceptor, context)
        assert context.aborts[0][0] is grpc.StatusCode.INVALID_ARGUMENT
    assert _not_sent(metrics) == 3
    lines = [r for r in caplog.records if "not sent" in r.getMessage()]
    assert len(lines) == 3, [r.getMessage() for r in caplog.records]
    assert "INVALID_ARGUMENT not sent, the call had already ended" in lines[0].getMessage()
    assert "ExecuteBatchError" in lines[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    # the failure itself is counted once per call, by its code, as before
    assert (
        metrics.registry.get_sample_value(
            "megascore_requests_total", {"rpc": "Score", "code": "INVALID_ARGUMENT"}
        )
        or metrics.registry.get_sample_value(
            "megascore_requests_total",
            {"front": "grpc", "rpc": "Score", "code": "INVALID_ARGUMENT"},
        )
    ) == 3


def test_a_status_sent_is_not_counted_as_not_sent():
    metrics = ServerMetrics()
    with pytest.raises(grpc.aio.AbortError):
        _fail(StatusInterceptor(metrics), _LiveCall())
    assert not _not_sent(metrics)

"""Reliability tests reuse the session's shared servers of ``tests/e2e`` (same processes).

Tests that kill, stop or signal a server start their own (:class:`ServeProcess`).
"""

from __future__ import annotations

import pytest

from tests.e2e.serve import own_servers, running, shared_server_fixture

shared_tp1 = shared_server_fixture("tp1")
shared_tp2 = shared_server_fixture("tp2")


@pytest.fixture
def serve(tmp_path):
    """``serve(*flags, **kw)`` starts a server of this test's own; all are killed after it."""
    yield from own_servers(tmp_path)


@pytest.fixture
def tp1(shared_tp1):
    """The shared ``--nproc 1`` server (checked alive)."""
    return running(shared_tp1)


@pytest.fixture
def tp2(shared_tp2):
    """The shared ``--nproc 2 --tensor-model-parallel-size 2`` server (checked alive)."""
    return running(shared_tp2)

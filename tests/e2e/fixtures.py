"""Server fixtures shared by ``tests/e2e`` and ``tests/reliability`` (a pytest plugin
registered once in ``tests/conftest.py``).

``shared_tp1`` / ``shared_tp2`` / ``shared_moe1``: the session's shared ``megascore
serve`` processes (``--nproc 1``, and ``--nproc 2 --tensor-model-parallel-size 2``) on
the built-in ``tiny`` model, and ``--nproc 1`` on ``tiny-moe`` (CPU, seed 1234), each
with a Prometheus endpoint, started on first use and
stopped with SIGTERM at the end of the session, which must exit 0 and leave no
process behind (:class:`tests.e2e.serve.SharedServers`). Tests that kill, stop or
signal a server start their own with ``serve``.
"""

from __future__ import annotations

import pytest

from tests.e2e.serve import own_servers, running, shared_server_fixture

shared_tp1 = shared_server_fixture("tp1")
shared_tp2 = shared_server_fixture("tp2")
shared_moe1 = shared_server_fixture("moe1")


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

"""Shared real servers for the end-to-end tests (one ``--nproc 1``, one ``--nproc 2`` TP=2).

Both are ``megascore serve`` subprocesses on the built-in ``tiny`` model (CPU, seed
1234) with a Prometheus endpoint, started on first use and stopped with SIGTERM at the
end of the session (which must exit 0 and leave no process behind).
``tests/reliability`` reuses the same processes through :mod:`tests.e2e.serve`.
"""

from __future__ import annotations

import pytest

from tests.e2e.reference import engine_outputs, sample_cases
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


@pytest.fixture(scope="session")
def cases():
    """The sample cases every parity test scores."""
    return sample_cases()


@pytest.fixture(scope="session")
def engine_reference(cases):
    """The outputs of the engine built in this process (no server) for ``cases``."""
    return engine_outputs([case.batch() for case in cases])

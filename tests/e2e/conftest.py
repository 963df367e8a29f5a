"""Parity references of the end-to-end tests (the servers: :mod:`tests.e2e.fixtures`)."""

from __future__ import annotations

import pytest

from testkit.reference import engine_outputs, sample_cases


@pytest.fixture(scope="session")
def cases():
    """The sample cases every parity test scores."""
    return sample_cases()


@pytest.fixture(scope="session")
def engine_reference(cases):
    """The outputs of the engine built in this process (no server) for ``cases``."""
    return engine_outputs([case.batch() for case in cases])

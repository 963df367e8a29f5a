"""Fixtures: a running fake megascore server and a sync client connected to it."""

from __future__ import annotations

import pytest

from megascore_client import ScoringClient
from tests.client.fake_server import FakeScorer, FakeServer


@pytest.fixture
def server():
    with FakeServer(FakeScorer()) as srv:
        yield srv


@pytest.fixture
def client(server):
    with ScoringClient(server.target, timeout=10.0) as c:
        yield c

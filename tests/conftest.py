"""Shared test setup: GPU marker handling, the --run-slow flag and shared fixtures.

``pgs``: a one-rank gloo world for in-process model tests (torch imported on use). The
real-server fixtures of ``tests/e2e`` and ``tests/reliability`` (``serve``, ``tp1``,
``tp2``, ``shared_tp1``, ``shared_tp2``) live in :mod:`tests.e2e.fixtures`.
"""

from __future__ import annotations

import pytest

from tests.one_rank import one_rank_parallel

pytest_plugins = ("tests.e2e.fixtures",)


@pytest.fixture(scope="module")
def pgs():
    """Megatron parallel state of a one-rank gloo world (TP = CP = EP = 1), per module."""
    yield from one_rank_parallel()


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="run long soak/load tests")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    has_cuda = None
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            if has_cuda is None:
                has_cuda = _cuda_available()
            if not has_cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        if item.get_closest_marker("slow") is not None and not config.getoption("--run-slow"):
            item.add_marker(pytest.mark.skip(reason="slow: pass --run-slow"))

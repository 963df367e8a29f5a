"""Shared test setup: GPU marker handling, the --run-slow flag and shared fixtures.

The real-server fixtures of ``tests/e2e`` and ``tests/reliability`` (``serve``, ``tp1``,
``tp2``, ``shared_tp1``, ``shared_tp2``) live in :mod:`tests.e2e.fixtures`.
"""

from __future__ import annotations

import pytest

pytest_plugins = ("tests.e2e.fixtures",)


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
        if "gpu" in item.keywords:
            if has_cuda is None:
                has_cuda = _cuda_available()
            if not has_cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(pytest.mark.skip(reason="slow: pass --run-slow"))

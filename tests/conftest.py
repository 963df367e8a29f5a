"""Shared test setup: GPU marker handling and the --run-slow flag."""

from __future__ import annotations

import pytest


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

"""A seed-shuffled test order, to find tests that lean on what ran before them (opt-in).

``bash scripts/test.sh -p tests.shuffle_order`` (``SHUFFLE_SEED``: the seed, default 1)
runs the modules in a shuffled order and each module's tests shuffled, a module's tests
still together (their module-scoped servers start once). docs/reliability.md "The suite".
"""

from __future__ import annotations

import os
import random

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    seed = int(os.environ.get("SHUFFLE_SEED", "1"))
    rng = random.Random(seed)
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = list(modules)
    rng.shuffle(order)
    for name in order:
        rng.shuffle(modules[name])
    items[:] = [item for name in order for item in modules[name]]


def pytest_report_header(config):
    return f"shuffle_order: SHUFFLE_SEED={os.environ.get('SHUFFLE_SEED', '1')}"

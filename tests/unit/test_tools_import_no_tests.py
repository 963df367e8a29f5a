"""``bench/``, ``scripts/`` and ``examples/`` never import from ``tests/`` (issue 34).

The tools stand on the products (``megascore``, ``megascore_server``,
``megascore_client``): what a tool shares with the tests lives in a product (the
server harness is :mod:`megascore_server.serve_process`) or in ``testkit/`` (tiny
checkpoints, the reference scoring, hostile requests, client load), not in ``tests``.
Every ``import`` / ``from ... import`` statement counts, at any depth (inside functions
too).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL_DIRS = ("bench", "scripts", "examples")


def imports_of_tests(path: Path) -> set[str]:
    """The modules of ``tests`` that ``path`` imports (``from tests import x``: ``tests.x``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "tests" and not node.level:
            names.update(f"tests.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module)
    return {name for name in names if name == "tests" or name.startswith("tests.")}


def test_the_tools_import_nothing_from_tests():
    found = {}
    for directory in TOOL_DIRS:
        for path in sorted((ROOT / directory).rglob("*.py")):
            if names := imports_of_tests(path):
                found[path.relative_to(ROOT).as_posix()] = names
    assert found == {}, "bench/, scripts/ and examples/ must not import tests.*"


def test_every_kind_of_import_of_tests_is_seen(tmp_path):
    probe = tmp_path / "tool.py"
    probe.write_text(
        "import json\n"
        "import tests.unit\n"
        "from tests import conftest\n"
        "from megascore_server.serve_process import ServeProcess\n"
        "def f():\n"
        "    from tests.e2e.serve import ServeProcess, SharedServers\n"
    )
    assert imports_of_tests(probe) == {"tests.unit", "tests.conftest", "tests.e2e.serve"}

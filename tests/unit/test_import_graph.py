"""No import circle in the product packages, not even through function-level imports.

Every ``import`` / ``from ... import`` statement of ``megascore``, ``megascore_server``
and ``megascore_client`` (at any depth: inside functions and ``TYPE_CHECKING`` blocks
too) is an edge from its module to the module it names; ``from pkg import sub`` names
the submodule ``sub`` when there is one. The graph must be acyclic (issue 34: a circle
works only while a half-loaded module happens to hold what the other side reads).
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "megascore": ROOT / "src" / "megascore",
    "megascore_server": ROOT / "server" / "megascore_server",
    "megascore_client": ROOT / "client" / "megascore_client",
}


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the product packages."""
    out = {}
    for package, directory in PACKAGES.items():
        for path in directory.rglob("*.py"):
            parts = (package, *path.relative_to(directory).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _known(name: str, mods: dict) -> str | None:
    """The product module ``name`` is, or is inside of (None: outside the products)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, path: Path, mods: dict) -> set[str]:
    """The product modules ``module`` imports anywhere in its file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    named = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            named += [
                f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
            ]
    return {m for m in (_known(n, mods) for n in named) if m is not None and m != module}


def test_the_import_graph_of_the_products_has_no_circle():
    mods = modules()
    products = {"megascore.api.schema", "megascore_server.service", "megascore_client.client"}
    assert products <= set(mods)
    graph = {module: imports(module, path, mods) for module, path in mods.items()}
    assert graph["megascore.api.selection"] >= {"megascore.api.schema", "megascore.api.types"}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        raise AssertionError(f"import circle: {' -> '.join(exc.args[1])}") from None


def test_a_circle_is_found(tmp_path, monkeypatch):
    """The check itself: two modules importing each other inside functions are caught."""
    package = tmp_path / "megascore"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from megascore import b\n")
    (package / "b.py").write_text("def g():\n    from megascore.a import f\n")
    monkeypatch.setitem(PACKAGES, "megascore", package)
    mods = {k: v for k, v in modules().items() if k.startswith("megascore.") or k == "megascore"}
    graph = {module: imports(module, path, mods) for module, path in mods.items()}
    assert graph["megascore.a"] == {"megascore.b"} and graph["megascore.b"] == {"megascore.a"}
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()

"""Import boundaries, read from the source trees (AST) and checked at run time.

* The client stands on the contract only: the generated stubs (``megascore.v1``) and
  the torch-free contract package (``megascore.api``: the table, the codec, the layout
  arithmetic, the errors), plus the package version; never the server, the engine or
  torch (torch only lazily, inside a function: the trainer adapters).
* The contract package imports nothing of the engine, the fronts or the client, and
  loads without torch.
* The server and the engine never import the client.
* The batcher works on domain types: no protobuf, stubs or codec in it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "client" / "megascore_client"
SERVER = ROOT / "server" / "megascore_server"
LIBRARY = ROOT / "src" / "megascore"
CONTRACT = ("megascore.v1", "megascore.api")
# the batcher and its helpers: the step planner and the pending-request bookkeeping
BATCHER = ("batcher.py", "batch_assembly.py", "pending.py")


def _package_of(path: Path) -> str:
    """Dotted package of a source file (``client/megascore_client/x.py`` ->
    ``megascore_client``)."""
    for top in (ROOT / "client", ROOT / "server", ROOT / "src"):
        if top in path.parents:
            return ".".join(path.relative_to(top).parent.parts)
    raise ValueError(path)


def _is_module(name: str) -> bool:
    """Whether ``name`` is a module or package of this repository (nothing imported)."""
    rel = Path(*name.split("."))
    return any(
        (top / rel).with_suffix(".py").is_file() or (top / rel).is_dir()
        for top in (ROOT / "client", ROOT / "server", ROOT / "src")
    )


def imports(path: Path, package: str | None = None) -> Iterator[tuple[str, bool, int]]:
    """``(module, lazy, line)`` of every import in ``path`` (a module of ``package``,
    by default the one its place in the repository says): ``lazy`` when it sits in a
    function body. ``from a import b`` yields ``a``, and ``a.b`` when that is a module."""
    package = package or _package_of(path)

    def visit(node: ast.AST, lazy: bool) -> Iterator[tuple[str, bool, int]]:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, lazy, child.lineno
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - child.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                yield base, lazy, child.lineno
                for alias in child.names:
                    if _is_module(f"{base}.{alias.name}"):
                        yield f"{base}.{alias.name}", lazy, child.lineno
            yield from visit(child, inner)

    yield from visit(ast.parse(path.read_text(), str(path)), False)


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _sources(root: Path) -> list[Path]:
    files = sorted(root.rglob("*.py"))
    return [f for f in files if not f.name.endswith(("_pb2.py", "_pb2_grpc.py"))]


def test_the_walker_sees_every_kind_of_import(tmp_path):
    """The AST walk is what the checks below trust: it must report relative, aliased,
    ``from`` and lazy imports."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch as t\n"
        "from megascore.api import types\n"
        "from . import errors\n"
        "from .results import ModelInfo\n"
        "def f():\n"
        "    import torch\n"
        "    from megascore_server.main import main\n"
    )
    found = {(m, lazy) for m, lazy, _ in imports(probe, "megascore_client")}
    assert {
        ("torch", False),
        ("megascore.api", False),
        ("megascore.api.types", False),
        ("megascore_client", False),
        ("megascore_client.errors", False),
        ("megascore_client.results", False),
        ("torch", True),
        ("megascore_server.main", True),
    } <= found


def test_the_client_imports_only_the_contract():
    bad = []
    for path in _sources(CLIENT):
        for module, lazy, line in imports(path):
            where = f"{path.relative_to(ROOT)}:{line}: {module}"
            if _within(module, ("megascore_server",)):
                bad.append(where)
            elif _within(module, ("megascore",)) and module != "megascore":
                if not _within(module, CONTRACT):
                    bad.append(where)
            elif _within(module, ("torch",)) and not lazy:
                bad.append(where + " (torch only inside a function)")
    assert not bad, "client imports outside the contract:\n" + "\n".join(bad)


def test_the_server_and_the_engine_never_import_the_client():
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for root in (SERVER, LIBRARY)
        for path in _sources(root)
        for module, _, line in imports(path)
        if _within(module, ("megascore_client",))
    ]
    assert not bad, "imports of the client:\n" + "\n".join(bad)


def test_the_contract_imports_nothing_of_its_users():
    """``megascore.api`` stands alone: numpy and the stubs, never the engine, the model,
    the checkpoint readers, a front, the client or torch (not even lazily)."""
    files = _sources(LIBRARY / "api")
    assert {"schema.py", "types.py", "wire.py", "layout.py"} <= {f.name for f in files}
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in files
        for module, _, line in imports(path)
        if _within(module, ("megascore", "megascore_server", "megascore_client", "torch"))
        and not _within(module, CONTRACT)
        and module != "megascore"
    ]
    assert not bad, "the contract imports its users:\n" + "\n".join(bad)


def test_the_contract_loads_without_torch():
    """At run time, with torch made unimportable: every contract module imports."""
    modules = sorted(p.stem for p in (LIBRARY / "api").glob("*.py") if p.stem != "__init__")
    code = (
        "import importlib, json, sys\n"
        "sys.modules['torch'] = None\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module('megascore.api.' + name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'megascore')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    assert len(modules) >= 8 and f"megascore.api.{modules[0]}" in loaded
    assert [m for m in loaded if not (m == "megascore" or _within(m, CONTRACT))] == []


def test_the_batcher_never_touches_protobuf():
    files = [SERVER / name for name in BATCHER if (SERVER / name).is_file()]
    assert SERVER / "batcher.py" in files and len(files) >= 3
    bad = [
        f"{path.name}:{line}: {module}"
        for path in files
        for module, _, line in imports(path)
        if _within(module, ("google.protobuf", "megascore.v1", "megascore_server.convert"))
    ]
    assert not bad, "protobuf in the batcher:\n" + "\n".join(bad)


def test_importing_the_client_loads_only_the_contract():
    """At run time too: what importing every client module pulls in."""
    modules = sorted(
        ".".join(p.relative_to(CLIENT).with_suffix("").parts) for p in _sources(CLIENT)
    )
    assert "push.requests" in modules
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(('megascore_client.' + name).removesuffix('.__init__'))\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('megascore', 'megascore_server', 'torch'))))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    allowed = ("megascore", *CONTRACT)
    assert [m for m in loaded if not (m == "megascore" or _within(m, allowed))] == []
    assert "megascore.api.wire" in loaded and "megascore.v1.scoring_pb2" in loaded


def test_every_client_module_declares_what_it_exports():
    """Helper modules say what they offer (``__all__``); the package's ``__all__`` (the
    public API) names only what exists."""
    for path in _sources(CLIENT):
        tree = ast.parse(path.read_text())
        declared = [
            node.value
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
        ]
        assert len(declared) == 1, f"{path.name}: no __all__"
        names = ast.literal_eval(declared[0])
        defined = {
            n.name
            for n in tree.body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        }
        defined |= {
            t.id
            for n in tree.body
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        # annotated only: a module __getattr__ builds it on first use (trl_grpo)
        defined |= {
            n.target.id
            for n in tree.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        }
        defined |= {
            a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names
        }
        assert set(names) <= defined, f"{path.name}: __all__ names {set(names) - defined}"

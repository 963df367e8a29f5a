"""The size rules of the product code (issue 34): no module over 500 lines but the
generated stubs, no function body over 60 lines. A file or a function that grows past
them is split by its jobs (docs/architecture.md)."""

from __future__ import annotations

import ast

from tests.unit.test_import_graph import modules

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _product_files():
    return [
        path for path in modules().values() if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    ]


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function after its docstring, to its last line."""
    body = node.body
    first = body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    start = body[1].lineno if docstring and len(body) > 1 else first.lineno
    return node.end_lineno - start + 1


def test_no_product_module_is_over_500_lines():
    files = _product_files()
    assert len(files) > 100  # the walk found the packages
    over = {str(p): n for p in files if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_no_product_function_is_over_60_lines():
    over = {}
    for path in _product_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if (n := _body_lines(node)) > MAX_FUNCTION_LINES:
                    over[f"{path.name}:{node.name}"] = n
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines: {over}"

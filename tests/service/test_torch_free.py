"""The server package never imports torch (only the real engine's factory does, lazily)."""

from __future__ import annotations

import subprocess
import sys

MODULES = [
    "megascore_server",
    "megascore_server.main",
    "megascore_server.bootstrap",
    "megascore_server.launcher",
    "megascore_server.ports",
    "megascore_server.preflight",
    "megascore_server.servicer",
    "megascore_server.batcher",
]


def test_server_modules_do_not_import_torch():
    code = (
        "import importlib, sys\n"
        f"for m in {MODULES!r}: importlib.import_module(m)\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr

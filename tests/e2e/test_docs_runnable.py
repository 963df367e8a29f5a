"""The doc blocks marked ``<!-- docs-test: run -->`` run as written against the shared
tiny server (``127.0.0.1:50051`` in a block becomes its address); see
:mod:`tests.docs_blocks`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_blocks import DEFAULT_TARGET, ROOT, blocks

RUNNABLE = [b for b in blocks() if b.runnable]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(ROOT / p) for p in ("src", "server", "client", "."))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def test_some_blocks_are_runnable():
    assert {b.path.name for b in RUNNABLE} >= {"README.md"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.where)
def test_runnable_block_runs_as_written(block, tp1, tmp_path):
    text = block.text.replace(DEFAULT_TARGET, tp1.target)
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the paths the docs use
    if block.lang == "python":
        argv = [sys.executable, "-c", text]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", text]
    proc = subprocess.run(
        argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{block.where}:\n{proc.stdout}\n{proc.stderr}"

"""A module of ``scripts/`` (not a package) imported by name, for the tests of a script."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def script_module(name: str):
    """``scripts/<name>.py`` executed as module ``name`` (in ``sys.modules``: dataclasses
    look their module up)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

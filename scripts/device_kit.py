"""The wheels a bare CUDA host needs beyond torch, for ``scripts/device_kit.sh``.

Prints one ``name==version`` line per distribution: the closure of megascore's
requirements (``[server,cli]`` from pyproject.toml, plus what ``scripts/gpu_check.sh``
itself runs: transformers for the HF references, pytest for ``tests/gpu``, and
setuptools / wheel to build the editable install offline), each at the version
installed in the interpreter running this script (the versions the project is tested
with), with markers evaluated for the target Python. torch and everything torch
itself requires are left out: a host that has torch has them.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
CHECK_NEEDS = ("transformers", "pytest", "pytest-timeout", "setuptools>=77", "wheel")


def _roots() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    specs = project["dependencies"] + extras["server"] + extras["cli"] + list(CHECK_NEEDS)
    return [Requirement(s) for s in specs]


def _closure(roots: list[Requirement], env: dict, stop: set[str]) -> dict[str, str | None]:
    """name -> installed version (None: not installed here) for ``roots`` and their needs."""
    found: dict[str, str | None] = {}
    todo = list(roots)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in found or name in stop:
            continue
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            found[name] = None
            continue
        found[name] = dist.version
        for spec in dist.requires or ():
            child = Requirement(spec)
            if child.marker is None or child.marker.evaluate(env):  # extras: none
                todo.append(child)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python", required=True, help="target Python, X.Y")
    args = parser.parse_args()
    env = default_environment() | {
        "python_version": args.python,
        "python_full_version": f"{args.python}.0",
        "extra": "",
    }
    # setuptools: torch asks for any; the offline editable build needs >= 77
    torch_side = set(_closure([Requirement("torch")], env, set())) - {"setuptools"}
    for name, version in sorted(_closure(_roots(), env, torch_side).items()):
        print(f"{name}=={version}" if version else name)
    return 0


if __name__ == "__main__":
    sys.exit(main())

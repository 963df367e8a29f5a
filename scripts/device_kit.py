"""The wheels a bare CUDA host needs beyond torch, for ``scripts/device_kit.sh``.

Prints one ``name==version`` line per distribution: the closure of megascore's
requirements (``[server,cli]`` from pyproject.toml, plus what ``scripts/gpu_check.sh``
itself runs: transformers for the HF references, pytest for ``tests/gpu``, and
setuptools / wheel to build the editable install offline), each at the version
installed in the interpreter running this script (the versions the project is tested
with), with markers evaluated for the target Python. torch and everything torch
itself requires are left out: a host that has torch has them.

``--size DIR`` instead checks what a device run carries: the kit's wheels in DIR and
the working tree that travels with them (git's tracked files and the untracked ones it
does not ignore), together at most 64 MiB; exit status 1 above.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a device host's Python without packaging (kit_install.py): pip's
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
CHECK_NEEDS = ("transformers", "pytest", "pytest-timeout", "setuptools>=77", "wheel")
LIMIT_MIB = 64  # what a device run carries at most, the working tree included
MIB = 1 << 20


def roots() -> list[Requirement]:
    """megascore's [server,cli] requirements and what scripts/gpu_check.sh runs."""
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
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--python", help="target Python, X.Y: print the kit's list")
    mode.add_argument("--size", type=Path, metavar="DIR", help="check the kit DIR's size")
    args = parser.parse_args()
    if args.size is not None:
        return 0 if check_size(args.size) else 1
    env = default_environment() | {
        "python_version": args.python,
        "python_full_version": f"{args.python}.0",
        "extra": "",
    }
    # setuptools: torch asks for any; the offline editable build needs >= 77
    torch_side = set(_closure([Requirement("torch")], env, set())) - {"setuptools"}
    for name, version in sorted(_closure(roots(), env, torch_side).items()):
        print(f"{name}=={version}" if version else name)
    return 0


def carried_bytes(kit: Path, root: Path = ROOT) -> tuple[int, int]:
    """Bytes of the wheels in ``kit`` and of ``root``'s working tree that travels with
    them: the files git tracks and the untracked ones it does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, capture_output=True, check=True,
    ).stdout  # fmt: skip
    paths = (root / name for name in listed.decode().split("\0") if name)
    tree = sum(path.stat().st_size for path in paths if path.is_file())
    return sum(wheel.stat().st_size for wheel in kit.glob("*.whl")), tree


def check_size(kit: Path, root: Path = ROOT, limit_mib: float = LIMIT_MIB) -> bool:
    """Prints the kit's and the working tree's size; whether together they fit."""
    wheels, tree = carried_bytes(kit, root)
    count = len(list(kit.glob("*.whl")))
    total = wheels + tree
    print(
        f"device-kit: {count} wheels {wheels / MIB:.1f} MiB + working tree "
        f"{tree / MIB:.1f} MiB = {total / MIB:.1f} MiB of {limit_mib} MiB carried, in {kit}"
    )
    if total > limit_mib * MIB:
        print(f"device-kit: over the {limit_mib} MiB a device run carries", file=sys.stderr)
    return total <= limit_mib * MIB


if __name__ == "__main__":
    sys.exit(main())

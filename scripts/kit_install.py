"""Which wheels of the device kit to install over a host's Python, for ``scripts/gpu_check.sh``.

The kit (``scripts/device_kit.sh``) is made elsewhere, at the project venv's versions;
the host (an NGC image, a lent machine) has torch and what its own packages were built
with (numpy, often transformers). ``gpu_check.sh`` installs the kit with ``--no-deps``
into a venv that sees the host's site directories, so a wheel installed there shadows
the host's copy. This script, run by that venv's Python, keeps the host's copy of every
distribution the host has at a version that every requirement of megascore and of the
kit accepts, and prints the paths of the other wheels, one a line (a line on stderr per
distribution kept).

What the kit does not carry must come from the host: torch above all. A requirement on
such a distribution that the host does not meet (megatron-core's ``torch>=2.6.0`` on an
older torch) is named with its requirer and the host's version, and the exit status is
1, before anything is installed.

    python scripts/kit_install.py KIT_DIR
"""

from __future__ import annotations

import sys
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from importlib.metadata import distributions
from pathlib import Path

from device_kit import Requirement, canonicalize_name, default_environment, roots


@dataclass(frozen=True)
class Wheel:
    """One wheel of the kit: its distribution, version and requirements."""

    name: str
    version: str
    path: Path
    requires: tuple[Requirement, ...]


def read_wheel(path: Path) -> Wheel:
    """The name, version and ``Requires-Dist`` of a wheel, from its METADATA."""
    with zipfile.ZipFile(path) as archive:
        member = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(archive.read(member).decode("utf-8"))
    requires = tuple(Requirement(spec) for spec in meta.get_all("Requires-Dist") or ())
    return Wheel(canonicalize_name(meta["Name"]), meta["Version"], path, requires)


def host_versions() -> dict[str, str]:
    """name -> version of every distribution this Python sees (the host's, here)."""
    return {canonicalize_name(d.metadata["Name"]): d.version for d in distributions()}


def plan(
    kit: list[Wheel], host: dict[str, str], wanted: list[Requirement]
) -> tuple[list[Wheel], list[str], list[str]]:
    """Splits the kit into wheels to install and host distributions to keep.

    Args:
        kit: the kit's wheels.
        host: the host's distributions (name -> version).
        wanted: what must be installed (megascore's requirements, the check's needs).

    Returns:
        ``(install, kept, problems)``: the wheels to install; a line per host
        distribution kept; a line per requirement on a distribution the kit does not
        carry that the host does not meet (then nothing may be installed).
    """
    env = default_environment() | {"extra": ""}
    needs = [("megascore", r) for r in wanted] + [
        (f"{w.name} {w.version}", r) for w in kit for r in w.requires
    ]
    needs = [(who, r) for who, r in needs if r.marker is None or r.marker.evaluate(env)]

    def accepted(name: str, version: str) -> bool:
        return all(
            r.specifier.contains(version, prereleases=True)
            for _, r in needs
            if canonicalize_name(r.name) == name
        )

    install, kept = [], []
    for wheel in kit:
        have = host.get(wheel.name)
        if have is not None and accepted(wheel.name, have):
            kept.append(f"{wheel.name} {have} (the host's; the kit has {wheel.version})")
        else:
            install.append(wheel)
    carried = {w.name for w in kit}
    problems = []
    for who, r in needs:
        name = canonicalize_name(r.name)
        if name in carried:
            continue
        have = host.get(name)
        if have is None:
            problems.append(f"{who} needs {r}: the host has no {r.name} and the kit none")
        elif not r.specifier.contains(have, prereleases=True):
            problems.append(
                f"{who} needs {r}, the host has {r.name} {have} (the kit carries no "
                f"{r.name} and installs with --no-deps): use a host whose {r.name} meets it"
            )
    return install, kept, problems


def main(argv: list[str]) -> int:
    kit = [read_wheel(path) for path in sorted(Path(argv[0]).glob("*.whl"))]
    install, kept, problems = plan(kit, host_versions(), roots())
    for line in kept:
        print(f"gpu_check: keeping {line}", file=sys.stderr)
    for line in problems:
        print(f"gpu_check: {line}", file=sys.stderr)
    if problems:
        return 1
    for wheel in install:
        print(wheel.path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

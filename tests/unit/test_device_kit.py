"""scripts/device_kit.py: the wheels a torch-only CUDA host needs, and only those.

The list is read from this environment's installed metadata (no registry): it must
hold megascore's server and CLI requirements and what scripts/gpu_check.sh runs, at
the versions installed here, and leave out torch and everything torch requires.
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import distribution, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def _kit(python: str) -> dict[str, str | None]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "device_kit.py"), "--python", python],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    pins = {}
    for line in proc.stdout.split():
        name, _, pinned = line.partition("==")
        pins[name] = pinned or None
    return pins


def test_kit_holds_megascores_needs_at_the_installed_versions_and_not_torch():
    pins = _kit("3.12")
    needed = ("megatron-core", "grpcio", "protobuf", "grpcio-health-checking", "numpy")
    needed += ("safetensors", "prometheus-client", "psutil", "pyyaml", "transformers", "pytest")
    for name in needed:
        assert pins[name] == version(name), name
    assert "setuptools" in pins and "wheel" in pins  # the offline editable build
    reqs = [Requirement(r) for r in distribution("torch").requires]
    torch_needs = {
        canonicalize_name(r.name)
        for r in reqs
        if r.marker is None or r.marker.evaluate({"extra": ""})
    }
    assert "torch" not in pins
    assert not (set(pins) & (torch_needs - {"setuptools"})), set(pins) & torch_needs

"""scripts/device_kit.py: the wheels a torch-only CUDA host needs, and only those.

The list is read from this environment's installed metadata (no registry): it must
hold megascore's server and CLI requirements and what scripts/gpu_check.sh runs, at
the versions installed here, and leave out torch and everything torch requires.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
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


def _scripts(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import device_kit
    import kit_install

    return device_kit, kit_install


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


def test_the_size_check_counts_the_working_tree_that_travels(tmp_path, monkeypatch):
    device_kit, _ = _scripts(monkeypatch)
    root, kit = tmp_path / "tree", tmp_path / "tree" / ".whl"
    kit.mkdir(parents=True)
    (root / ".gitignore").write_text("/.whl/\n/ignored.bin\n")  # 20 bytes
    (root / "tracked.py").write_bytes(b"x" * 3000)
    (root / "untracked.py").write_bytes(b"y" * 2000)
    (root / "ignored.bin").write_bytes(b"z" * 50_000)  # stays home
    (kit / "a-1-py3-none-any.whl").write_bytes(b"w" * 40_000)
    _git(root, "init", "-q")
    _git(root, "add", "tracked.py", ".gitignore")
    assert device_kit.carried_bytes(kit, root) == (40_000, 5020)
    mib = 1 << 20
    # the wheels alone fit, with the tree they do not
    assert device_kit.check_size(kit, root, limit_mib=46_000 / mib)
    assert not device_kit.check_size(kit, root, limit_mib=42_000 / mib)


def _wheel(directory: Path, name: str, version: str, *requires: str) -> Path:
    path = directory / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    lines = [f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    meta = "Metadata-Version: 2.1\n" + "\n".join(lines) + "\n"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta)
    return path


def _kit_of(tmp_path: Path, torch_req: str) -> list:
    _wheel(tmp_path, "megatron-core", "0.19.2", f"torch{torch_req}", "numpy", "packaging>=24.2")
    _wheel(tmp_path, "numpy", "2.3.0")
    _wheel(tmp_path, "transformers", "5.8.0", "numpy>=1.17", 'pytest; extra == "testing"')
    _wheel(tmp_path, "packaging", "26.0")
    return sorted(tmp_path.glob("*.whl"))


def test_the_hosts_accepted_versions_are_kept_over_the_kits(tmp_path, monkeypatch):
    _, kit_install = _scripts(monkeypatch)
    kit = [kit_install.read_wheel(p) for p in _kit_of(tmp_path, ">=2.6.0")]
    host = {"torch": "2.11.0a0+nv25.10", "numpy": "1.26.4", "transformers": "4.40.0"}
    host["packaging"] = "23.1"  # below megatron-core's >= 24.2: the kit's goes in
    wanted = [Requirement("numpy>=1.26"), Requirement("transformers"), Requirement("torch>=2.6")]
    install, kept, problems = kit_install.plan(kit, host, wanted)
    assert sorted(w.name for w in install) == ["megatron-core", "packaging"]
    assert [line.split()[0] for line in kept] == ["numpy", "transformers"]
    assert problems == []
    host["numpy"] = "1.25.0"  # refused by numpy>=1.26: the kit's numpy goes in
    install, _, _ = kit_install.plan(kit, host, wanted)
    assert "numpy" in {w.name for w in install}


def test_a_host_torch_megatron_core_refuses_stops_the_install(tmp_path, monkeypatch, capsys):
    _, kit_install = _scripts(monkeypatch)
    monkeypatch.setattr(kit_install, "host_versions", lambda: {"torch": "2.5.1", "numpy": "2.0"})
    monkeypatch.setattr(kit_install, "roots", lambda: [Requirement("numpy>=1.26")])
    _kit_of(tmp_path, ">=2.6.0")
    assert kit_install.main([str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""  # nothing installed
    assert "megatron-core 0.19.2 needs torch>=2.6.0, the host has torch 2.5.1" in err
    assert "keeping numpy 2.0 (the host's; the kit has 2.3.0)" in err
    monkeypatch.setattr(kit_install, "host_versions", lambda: {"torch": "2.11.0", "numpy": "2.0"})
    assert kit_install.main([str(tmp_path)]) == 0
    installed = capsys.readouterr().out.split()
    assert installed == [
        str(tmp_path / f"{name}-py3-none-any.whl")
        for name in ("megatron_core-0.19.2", "packaging-26.0", "transformers-5.8.0")
    ]

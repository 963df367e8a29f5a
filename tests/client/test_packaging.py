"""The client is light: no torch, no server package; the example and console script run."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from megascore_client import cli
from tests.client.fake_server import FakeServer, ref_logprobs

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_import_leaves_torch_and_server_out():
    code = (
        "import sys, json\n"
        "import megascore_client, megascore_client.cli, megascore_client.aio\n"
        "print(json.dumps({m: m in sys.modules for m in "
        "('torch', 'megascore_server', 'transformers', 'tqdm')}))\n"
    )
    proc = _run("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "torch": False,
        "megascore_server": False,
        "transformers": False,
        "tqdm": False,
    }


def test_console_script_is_the_cli_main(capsys):
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="megascore")
    assert script.load() is cli.main
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("megascore ")


def _load_example():
    path = ROOT / "examples" / "rl_rollout_scoring.py"
    spec = importlib.util.spec_from_file_location("rl_rollout_scoring", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rl_rollout_example_runs_against_a_server(tmp_path, capsys):
    rollouts = [
        {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "response_logprobs": [-0.5, -0.1]},
        {"prompt_ids": [7], "response_ids": [8, 9, 10], "response_logprobs": [-1.0, -0.2, -0.3]},
    ]
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rollouts))
    example = _load_example()
    with FakeServer() as srv:
        assert (
            example.main(["--target", srv.target, "--microbatch", "1", "--rollouts", str(path)])
            == 0
        )
        out = capsys.readouterr().out
        assert srv.scorer.calls["ScoreStream"] == 1
        assert [r["request_id"] for r in srv.scorer.requests] == ["rollouts-0", "rollouts-1"]
        assert example.main(["--target", srv.target, "--num-rollouts", "20"]) == 0
        assert "rollouts: 20" in capsys.readouterr().out
    ref = np.concatenate([ref_logprobs([1, 2, 3, 4, 5])[3:], ref_logprobs([7, 8, 9, 10])[1:]])
    sampler = np.array([-0.5, -0.1, -1.0, -0.2, -0.3])
    k1 = float((sampler - ref).mean())
    line = next(x for x in out.splitlines() if x.startswith("mean KL"))
    assert f"k1 {k1:.5f}" in line
    assert "response tokens: 5" in out


def _floor(spec_name: str) -> tuple[int, ...]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if re.match(rf"{spec_name}\s*>=", d)]
    return tuple(int(x) for x in spec.split(">=")[1].split("."))


def test_generated_stubs_ask_for_no_more_than_the_declared_floors():
    """A stub that validates its runtime must not demand more than pyproject declares
    (CI's floors job imports them at exactly those versions: scripts/floors_check.sh)."""
    stubs = ROOT / "src" / "megascore" / "v1"
    pb2 = (stubs / "scoring_pb2.py").read_text()
    grpc_stub = (stubs / "scoring_pb2_grpc.py").read_text()
    check = re.search(r"ValidateProtobufRuntimeVersion\([^,]+,\s*(\d+),\s*(\d+),\s*(\d+)", pb2)
    if check:
        assert tuple(map(int, check.groups())) <= _floor("protobuf")
    pinned = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_stub)
    if pinned:
        assert tuple(map(int, pinned.group(1).split("."))) <= _floor("grpcio")

"""Mistakes in a serve configuration are refused before any rank starts.

A layout that does not fit the ranks, a model string naming nothing and ``--device
cuda`` without CUDA exit 2 from ``megascore serve`` itself, with the fix in the
message, without importing torch (the ranks would find them only after importing
torch and Megatron: 5 to 40 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megascore.config import EngineConfig
from megascore_server.config import ReplicaConfig
from megascore_server.preflight import check_before_launch, cuda_device_count, fitting_world_size

ROOT = Path(__file__).resolve().parents[2]

# argv -> words the error must contain (the fix first).
MISTAKES = {
    ("--tp", "2"): ["--tp 2 needs --nproc 2", "multiple of TP x CP x PP"],
    ("--nproc", "3", "--pp", "2"): ["--pp 2 needs --nproc 2 or 4"],
    ("--nproc", "2", "--tp", "2", "--ep", "2", "--model", "tiny-moe"): ["needs --nproc 4"],
    ("--model", "nosuch"): ["unknown model 'nosuch'", "tiny-deep", "hf:DIR"],
    ("--model", "hf:/no/such/dir"): ["/no/such/dir is not a directory"],
    ("--model", "megatron:/no/such/dir"): ["/no/such/dir is not a directory"],
    ("--model", "tiny", "--nproc", "3", "--pp", "3"): ["--pp 3: model tiny has 2 decoder layers"],
    ("--nproc", "2", "--ep", "2"): ["--ep 2: model tiny has no MoE layers"],
    ("--model", "tiny-moe", "--nproc", "3", "--ep", "3"): ["4 experts per MoE layer"],
}

PROBE = (
    "import sys\n"
    "from megascore_server.main import main\n"
    "code = main(sys.argv[1:])\n"
    "assert 'torch' not in sys.modules, 'torch imported'\n"
    "sys.exit(code)\n"
)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(str(ROOT / p) for p in ("src", "server", "client", "."))
    return env


@pytest.mark.parametrize("argv", list(MISTAKES), ids=[" ".join(a) for a in MISTAKES])
def test_mistake_refused_before_any_rank_starts(argv, capsys):
    from megascore_server.main import main

    assert main([*argv, "--port", "0"]) == 2
    err = capsys.readouterr().err
    for words in MISTAKES[argv]:
        assert words in err, err


def test_checkpoint_directories_are_checked(tmp_path, capsys):
    from megascore_server.main import main

    assert main(["--model", f"megatron:{tmp_path}", "--port", "0"]) == 2
    assert "megascore.json is missing; not a megascore Megatron checkpoint" in (
        capsys.readouterr().err
    )
    assert main(["--model", f"hf:{tmp_path}", "--port", "0"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_refusal_is_fast_and_torch_free():
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, "--tp", "2", "--port", "0"],
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    assert "--tp 2 needs --nproc 2" in proc.stderr
    assert elapsed < 10, elapsed  # ~1 s: the interpreter and grpc, no torch (asserted above)


def test_torchrun_world_size_names_torchrun_flag(monkeypatch, capsys):
    from megascore_server.main import main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["--tp", "2", "--port", "0"]) == 2
    assert "--tp 2 needs --nproc-per-node 2 or 4 to torchrun" in capsys.readouterr().err


def test_launched_rank_does_not_check_again(monkeypatch):
    """Ranks started by ``--nproc`` get the config the launcher already checked."""
    from megascore_server import main as main_module

    config = ReplicaConfig(engine=EngineConfig(model="tiny"), nproc=2)
    monkeypatch.setenv("_MEGASCORE_RESOLVED_CONFIG", json.dumps(config.to_dict()))
    monkeypatch.setenv("_MEGASCORE_LAUNCHED", "1")
    monkeypatch.setattr(main_module, "check_before_launch", lambda *a, **k: 1 / 0)
    monkeypatch.setattr(main_module, "run_rank", lambda config: 0)
    monkeypatch.setattr(main_module, "setup_logging", lambda level: None)  # no global state
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main_module.main([]) == 0


@pytest.mark.parametrize(
    ("sizes", "at_least", "world"),
    [
        ({}, 1, 1),
        ({"tensor_model_parallel_size": 2}, 3, 4),
        ({"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2}, 1, 4),
        ({"context_parallel_size": 2, "expert_model_parallel_size": 4}, 1, 4),
        ({"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 3}, 4, 6),
    ],
)
def test_fitting_world_size(sizes, at_least, world):
    engine = EngineConfig(**sizes)
    fit = fitting_world_size(engine, at_least)
    assert fit == world and fit >= at_least
    dp = fit // engine.model_parallel_size
    assert fit % engine.model_parallel_size == 0
    assert (dp * engine.context_parallel_size) % engine.expert_model_parallel_size == 0


def test_device_cuda_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr("megascore_server.preflight.cuda_device_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    config = ReplicaConfig(engine=EngineConfig(device="cuda"))
    with pytest.raises(ValueError, match="--device cuda: no CUDA device.*use --device cpu"):
        check_before_launch(config, 1, torchrun=False)


def test_cuda_device_count_agrees_with_torch():
    torch = pytest.importorskip("torch")
    assert cuda_device_count() == torch.cuda.device_count()


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_more_ranks_than_gpus_is_refused_naming_both(monkeypatch, device):
    monkeypatch.setattr("megascore_server.preflight.cuda_device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = ReplicaConfig(engine=EngineConfig(device=device), nproc=4)
    with pytest.raises(ValueError, match=r"--nproc 4 starts 4 ranks .* shows 2 CUDA device"):
        check_before_launch(config, 4, torchrun=False)
    check_before_launch(config, 2, torchrun=False)  # one GPU per rank fits


def test_torchrun_counts_the_ranks_of_this_host(monkeypatch):
    monkeypatch.setattr("megascore_server.preflight.cuda_device_count", lambda: 8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    config = ReplicaConfig(engine=EngineConfig(device="cuda", tensor_model_parallel_size=8))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    check_before_launch(config, 16, torchrun=True)  # two hosts of 8: fits
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    with pytest.raises(ValueError, match=r"--nproc-per-node 16 .* shows 8 CUDA device.*'0,1,2"):
        check_before_launch(config, 16, torchrun=True)


def test_cpu_serving_ignores_the_gpu_count(monkeypatch):
    monkeypatch.setattr("megascore_server.preflight.cuda_device_count", lambda: 1)
    check_before_launch(
        ReplicaConfig(engine=EngineConfig(device="cpu"), nproc=4), 4, torchrun=False
    )

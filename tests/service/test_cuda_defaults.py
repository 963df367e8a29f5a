"""Issue 45: ``megascore serve`` sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for
a replica on CUDA before torch is imported (the ranks inherit it), unless the user set
it; a CPU replica's environment is left alone."""

from __future__ import annotations

import pytest

from megascore.config import EngineConfig
from megascore_server import main as main_module
from megascore_server.cuda_defaults import ALLOC_CONF, ALLOC_CONF_ENV, apply_cuda_defaults

RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _served_env(monkeypatch, argv: list[str], gpus: int) -> str | None:
    """The allocator variable the rank sees, ``megascore serve argv`` on a host of ``gpus``."""
    seen = []
    monkeypatch.setattr(main_module, "cuda_device_count", lambda: gpus)
    monkeypatch.setattr(main_module, "check_before_launch", lambda *a, **k: None)
    monkeypatch.setattr(main_module, "setup_logging", lambda level: None)
    monkeypatch.setattr(main_module, "raise_open_files_limit", lambda: None)

    def run_rank(config) -> int:
        seen.append(main_module.os.environ.get(ALLOC_CONF_ENV))
        return 0

    monkeypatch.setattr(main_module, "run_rank", run_rank)
    # unset, and put back as they were after the test: main() sets the rendezvous
    # variables of a single process (a later test in this process would take it for a
    # torchrun rank: test_preflight did, after this module)
    for name in (*RENDEZVOUS, "_MEGASCORE_LAUNCHED", "_MEGASCORE_RESOLVED_CONFIG"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert main_module.main(argv) == 0
    return seen[0]


@pytest.mark.parametrize(("device", "gpus"), [("cuda", 1), ("auto", 2)])
def test_set_for_a_cuda_replica(monkeypatch, device, gpus):
    monkeypatch.setenv(ALLOC_CONF_ENV, "placeholder")
    monkeypatch.delenv(ALLOC_CONF_ENV)  # unset, restored to its state after the test
    assert _served_env(monkeypatch, ["--device", device, "--port", "0"], gpus) == ALLOC_CONF


def test_a_users_value_is_kept(monkeypatch):
    monkeypatch.setenv(ALLOC_CONF_ENV, "max_split_size_mb:512")
    got = _served_env(monkeypatch, ["--device", "cuda", "--port", "0"], 1)
    assert got == "max_split_size_mb:512"


@pytest.mark.parametrize(("device", "gpus"), [("cpu", 4), ("auto", 0)])
def test_left_alone_for_a_cpu_replica(monkeypatch, device, gpus):
    monkeypatch.setenv(ALLOC_CONF_ENV, "placeholder")
    monkeypatch.delenv(ALLOC_CONF_ENV)
    environ: dict[str, str] = {}
    apply_cuda_defaults(EngineConfig(device=device), environ, gpus)
    assert environ == {}
    assert _served_env(monkeypatch, ["--device", device, "--port", "0"], gpus) is None


@pytest.mark.parametrize(
    ("argv", "gpus", "warned"),
    [
        (["--device", "cuda"], 1, True),  # the default dtype, float32
        (["--device", "auto", "--dtype", "float32"], 8, True),
        (["--device", "cuda", "--dtype", "bfloat16"], 1, False),
        (["--device", "auto"], 0, False),  # a CPU host
    ],
)
def test_float32_on_cuda_is_warned_naming_bfloat16(monkeypatch, caplog, argv, gpus, warned):
    monkeypatch.setenv(ALLOC_CONF_ENV, "expandable_segments:True")
    with caplog.at_level("WARNING", logger="megascore_server.main"):
        _served_env(monkeypatch, [*argv, "--port", "0"], gpus)
    found = [r.message for r in caplog.records if "serving in float32 on CUDA" in r.message]
    assert bool(found) == warned
    if warned:
        assert "--dtype bfloat16 is the faster choice" in found[0]

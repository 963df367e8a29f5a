"""Issue 45: what the engine sets up at start-up (``megascore.engine.ranks.startup``).

The timeouts around a model load: the agreements after a load run on their own gloo
group with ``load_timeout_s`` (ranks finish reading a large checkpoint minutes apart),
the step status group keeps 3 x ``collective_timeout_s`` and the default group (the
rendezvous) waits at least ``load_timeout_s``; the behaviour on two ranks (a late rank
waited for, a dead one seen at once) is tests/distributed/test_load_timeout.py. On
CUDA, half-precision GEMMs accumulate in float32.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from megascore.config import EngineConfig
from megascore.engine.ranks import startup


def test_each_control_group_gets_its_timeout(pgs, monkeypatch):
    timeouts = []
    real = dist.new_group

    def spy(ranks, *, backend, timeout):
        timeouts.append(timeout)
        return real(ranks, backend=backend, timeout=timeout)

    monkeypatch.setattr(dist, "new_group", spy)
    cfg = EngineConfig(collective_timeout_s=5.0, load_timeout_s=900.0)
    own: list = []
    status, command, load = startup.control_groups(cfg, own)
    try:
        assert own == [status, command, load]
        seconds = [t.total_seconds() for t in timeouts]
        assert seconds == [15.0, 5.0, 900.0]  # rank 0's command side: one collective timeout
        flags = torch.ones(1)
        dist.all_reduce(flags, group=load)  # a working gloo group over every rank
        assert flags.item() == 1.0
    finally:
        for group in own:
            dist.destroy_process_group(group)


@pytest.mark.parametrize(
    ("collective", "load", "expected"), [(5.0, 900.0, 900.0), (2000.0, 900.0, 2000.0)]
)
def test_the_rendezvous_waits_for_the_longer_of_both(pgs, monkeypatch, collective, load, expected):
    seen = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        startup, "init_default_group", lambda backend, timeout, device: seen.append(timeout)
    )
    cfg = EngineConfig(collective_timeout_s=collective, load_timeout_s=load)
    assert startup.init_distributed(cfg, torch.device("cpu")) is True
    assert seen == [datetime.timedelta(seconds=expected)]


def test_load_timeout_must_be_positive():
    with pytest.raises(ValueError, match="load_timeout_s"):
        EngineConfig(load_timeout_s=0)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_half_gemms_accumulate_in_float32_on_cuda(pgs, monkeypatch, device):
    """Issue 45: on CUDA the engine turns off cuBLAS's reduced-precision reductions of
    bf16 / fp16 GEMMs (the LM head), as the trainer's TE GEMMs accumulate in float32."""
    matmul = torch.backends.cuda.matmul
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # restored after the test
    before = (
        matmul.allow_bf16_reduced_precision_reduction,
        matmul.allow_fp16_reduced_precision_reduction,
    )
    matmul.allow_bf16_reduced_precision_reduction = True  # torch's default
    matmul.allow_fp16_reduced_precision_reduction = True
    try:
        assert startup.init_distributed(EngineConfig(), torch.device(device)) is False
        on_cuda = device == "cuda"
        assert matmul.allow_bf16_reduced_precision_reduction is not on_cuda
        assert matmul.allow_fp16_reduced_precision_reduction is not on_cuda
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before[0]
        matmul.allow_fp16_reduced_precision_reduction = before[1]

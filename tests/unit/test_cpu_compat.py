"""Issue 20 item 6: ``--device cpu`` on a host that has CUDA.

``cpu_compat.apply`` used to refuse when CUDA is available. Now, on such a host, it makes
the CPU the process's *current* device only: ``torch.cuda.current_device()``,
``Tensor.cuda()`` and ``torch.zeros(device="cuda")`` (what Megatron calls to place its
buffers) mean the CPU, while explicitly indexed CUDA devices and
``torch.cuda.synchronize`` keep their own behaviour. The CUDA host is simulated by
patching ``torch.cuda.is_available``; the stand-ins for what apply replaces record the
calls it passes on (a CPU-only host's ``.cuda(0)`` would raise). The whole model path on
a real CUDA host: ``tests/gpu/test_engine_cuda.py::test_cpu_model_on_a_cuda_host``.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings import (
    rope_utils,
    rotary_pos_embedding,
    yarn_rotary_pos_embedding,
)

from megascore.model import cpu_compat


@pytest.fixture
def fresh(monkeypatch):
    """cpu_compat not yet applied; everything apply replaces is restored afterwards, and
    the functions apply passes calls on to record them."""
    calls = []

    def cuda(self, device=None, *args, **kwargs):
        calls.append(("cuda", device))
        return "moved"

    def zeros(*args, **kwargs):
        calls.append(("zeros", kwargs.get("device")))
        return torch.empty(0)

    def synchronize(device=None):
        calls.append(("synchronize", device))

    monkeypatch.setattr(cpu_compat, "_APPLIED", False)
    monkeypatch.setattr(cpu_compat, "_ORIGINAL", {})
    monkeypatch.setattr(torch.Tensor, "cuda", cuda)
    monkeypatch.setattr(torch, "zeros", zeros)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "current_device", torch.cuda.current_device)
    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        monkeypatch.setattr(module, "get_pos_emb_on_this_cp_rank", None)
    return monkeypatch, calls, synchronize


def test_cuda_host_gets_the_cpu_as_current_device_only(fresh):
    monkeypatch, calls, synchronize = fresh
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cpu_compat.apply()  # used to raise RuntimeError here
    assert torch.cuda.current_device() == torch.device("cpu")
    assert rope_utils.get_pos_emb_on_this_cp_rank is cpu_compat._cpu_pos_emb_on_this_cp_rank
    t = torch.ones(3)
    assert t.cuda() is t and calls == []
    assert t.cuda(0) == "moved" and t.cuda("cuda:1") == "moved"
    torch.zeros(2, device="cuda")
    torch.zeros(2, device="cuda:0")
    torch.cuda.synchronize()
    assert torch.cuda.synchronize is synchronize  # a CUDA host's own, unchanged
    assert calls == [
        ("cuda", 0),
        ("cuda", "cuda:1"),
        ("zeros", "cpu"),
        ("zeros", "cuda:0"),
        ("synchronize", None),
    ]


def test_cpu_only_host_keeps_everything_on_the_cpu(fresh):
    monkeypatch, calls, synchronize = fresh
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu_compat.apply()
    t = torch.ones(3)
    assert t.cuda() is t and t.cuda(0) is t
    torch.zeros(2, device="cuda:0")
    torch.cuda.synchronize()
    assert torch.cuda.synchronize is not synchronize
    assert calls == [("zeros", "cpu")]

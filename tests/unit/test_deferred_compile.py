"""Megatron-Core's ``torch.compile`` deferred to the first call (``megascore.deferred_compile``):
a process that imports the engine does not import the compiler, and a deferred function
compiles once, at its first call, into what ``torch.compile`` makes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from megascore.deferred_compile import deferred_compile

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys
import megascore_server.main, megascore.engine.runtime, megascore.model.build
import megatron.core.jit, megatron.core.transformer.moe.router as router, torch
from megascore.deferred_compile import deferred_compile
print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
print(megatron.core.jit.jit_fuser is deferred_compile, torch.compile is not deferred_compile)
print(router.InferenceTopKRouter._compiled_topk_routing.__wrapped__.__name__)
"""


def test_importing_the_engine_does_not_import_the_compiler():
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True, text=True, timeout=120, check=True, cwd=ROOT,
    ).stdout.split("\n")
    assert out[0] == "[]"  # without the hook: ['torch._dynamo', 'torch._inductor']
    assert out[1] == "True True"  # Megatron's fuser deferred, torch's own compile restored
    assert out[2] == "_compiled_topk_routing"  # a direct @torch.compile is deferred too


def test_a_deferred_function_compiles_once_at_its_first_call(monkeypatch):
    made = []

    def counting_compile(fn, **options):
        made.append(options)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    monkeypatch.setattr(torch, "compile", counting_compile)

    @deferred_compile(dynamic=False)
    def add(x, y):
        """adds"""
        return x + y

    assert made == [] and add.__name__ == "add" and add.__doc__ == "adds"
    assert add(1, 2) == ("compiled", 3)
    assert add(3, 4) == ("compiled", 7)
    assert made == [{"dynamic": False}]


def test_a_deferred_function_gives_what_the_real_compile_gives():
    def f(x):
        return torch.nn.functional.silu(x) * x

    x = torch.randn(64)
    deferred = deferred_compile(f, backend="eager")
    assert torch.equal(deferred(x), torch.compile(f, backend="eager")(x))

"""Megatron-Core's compiled functions compiled at their first call, not at import.

Megatron-Core decorates functions with ``torch.compile`` as its modules load
(``megatron.core.jit`` sets ``jit_fuser = torch.compile`` for its fusions; the MoE
router's inference path is decorated directly). ``torch.compile(fn)`` imports
``torch._dynamo`` and ``torch._inductor`` there and then: about 2 s of CPU in every
process that imports Megatron-Core (each server rank, each torchrun rank), while a dense
model on the CPU calls none of those functions. :func:`install` puts an import hook
before Megatron's modules: while one of them executes, ``torch.compile`` is
:func:`deferred_compile`, the same ``torch.compile(fn, **options)`` made at the
function's first call. ``torch.compile`` compiles at the first call anyway; only the
import of the compiler moves there. Outside Megatron's module bodies ``torch.compile`` is
untouched.

Torch-free to import: the packages that import Megatron-Core (``megascore.model``,
``megascore.engine``, ``megascore.checkpoint``) call :func:`install` in their
``__init__``, before any of their modules can import it.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
import threading


def deferred_compile(fn=None, **options):
    """``torch.compile(fn, **options)``, made when ``fn`` is first called."""
    if fn is None:  # used as ``@jit_fuser(...)``
        return functools.partial(deferred_compile, **options)
    compiled = []
    lock = threading.Lock()

    @functools.wraps(fn)
    def compiled_at_first_call(*args, **kwargs):
        if not compiled:
            with lock:
                if not compiled:
                    import torch

                    compiled.append(torch.compile(fn, **options))
        return compiled[0](*args, **kwargs)

    return compiled_at_first_call


class _DeferringLoader(importlib.abc.Loader):
    """Runs a Megatron-Core module with ``torch.compile`` deferred while it executes."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        import torch

        compile_ = torch.compile
        torch.compile = deferred_compile
        try:
            self.loader.exec_module(module)
        finally:
            torch.compile = compile_


class _MegatronFinder(importlib.abc.MetaPathFinder):
    """Finds Megatron-Core's modules through the other finders and wraps their loaders."""

    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] != "megatron":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _DeferringLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Defers ``torch.compile`` in the Megatron-Core modules imported from now on
    (idempotent; modules already imported keep what they have)."""
    if not any(isinstance(f, _MegatronFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MegatronFinder())

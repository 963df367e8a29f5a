"""Batch-invariant matmuls: a token's numbers do not depend on what else is in the step.

Every matmul over the token axis (the parallel linears of attention, MLP, experts, MTP and
the output head; the MoE router's gate) gets a row count that is a multiple of
:data:`ROW_MULTIPLE`: the rows are padded with zeros before the matmul and cut off after.

Why that is enough on the CPU (measured, ``docs/engine.md`` "Batch invariance"): oneDNN /
MKL compute a row of ``x @ W.T`` with the same blocking of the inner dimension whatever
the number of rows, *except* for small row counts (1-3 rows with one thread, up to ~11
with eight), which take a matrix-vector path with another summation order. A sequence of
two tokens scored alone therefore differed from the same sequence inside a pack by one
ulp. Padding every matmul to at least (and a multiple of) 64 rows keeps every call on the
blocked path, at a cost below the noise for real steps (< 64 extra rows per matmul).

Everything else on the token axis is already per row (norms, RoPE, the chunked
log-softmax, embedding lookups) or per sequence (the attention of
:mod:`megascore.model.attention`, which runs each segment on its own), and the MoE
permutation sums a token's expert outputs in expert order, which does not depend on the
other tokens.

CUDA is not covered: cuBLAS and TransformerEngine choose kernels (split-K, tiles) by
shape; ``EngineConfig`` refuses ``batch_invariant`` on CUDA (docs/deploy.md, GPU plan).
"""

from __future__ import annotations

import functools

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.moe.router import TopKRouter

ROW_MULTIPLE = 64
"""Every token-axis matmul runs on a multiple of this many rows (zero rows appended)."""


_MARK = "_megascore_batch_invariant"


def is_batch_invariant(module: torch.nn.Module) -> bool:
    """Whether :func:`make_batch_invariant` changed ``module``."""
    return getattr(module, _MARK, False)


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with zero rows appended along dim 0 up to a multiple of :data:`ROW_MULTIPLE`
    (no rows: ``x`` as it is, there is no row to round differently; an expert that got
    no token then costs no matmul)."""
    extra = -x.shape[0] % ROW_MULTIPLE
    if not extra:
        return x
    return torch.cat([x, x.new_zeros(extra, *x.shape[1:])])


def _linear_impl(
    original, *, input, weight, bias=None, sequence_parallel=False, tp_group=None, **kwargs
):
    """A parallel linear's ``_forward_impl`` on row-padded input.

    Under sequence parallelism Megatron all-gathers the input over TP inside the impl;
    the gather happens here first, so the padding is added to the gathered rows.
    """
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, False, group=tp_group)
    rows = input.shape[0]
    out = original(
        input=pad_rows(input),
        weight=weight,
        bias=bias,
        sequence_parallel=False,
        tp_group=tp_group,
        **kwargs,
    )
    return out[:rows]


def _router_gating(original, input: torch.Tensor) -> torch.Tensor:
    """``TopKRouter.gating`` on row-padded input (``[tokens, hidden]``)."""
    rows = input.shape[0]
    return original(pad_rows(input))[:rows]


def make_batch_invariant(model: torch.nn.Module) -> int:
    """Pads the rows of every token-axis matmul of ``model`` (in place, idempotent).

    Args:
        model: a Megatron ``GPTModel`` (or any module) built with the local linears.

    Returns:
        How many modules were changed.
    """
    changed = 0
    for module in model.modules():
        if is_batch_invariant(module):
            continue
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            module._forward_impl = functools.partial(_linear_impl, module._forward_impl)
        elif isinstance(module, TopKRouter):
            module.gating = functools.partial(_router_gating, module.gating)
        else:
            continue
        setattr(module, _MARK, True)
        changed += 1
    return changed

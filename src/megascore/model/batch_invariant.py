"""Batch-invariant matmuls and activations: a token's numbers do not depend on what else
is in the step.

Every matmul over the token axis (the parallel linears of attention, MLP, experts, MTP and
the output head; the MoE router's gate) gets at least :data:`MIN_ROWS` rows: fewer are
padded with zeros before the matmul and cut off after.

Why that is enough on the CPU (measured, ``docs/engine.md`` "Batch invariance"): oneDNN /
MKL compute a row of ``x @ W.T`` with the same blocking of the inner dimension whatever
the number of rows, *except* for small row counts (1-3 rows with one thread, up to ~11
with eight), which take a matrix-vector path with another summation order. Some CPUs
split small calls otherwise (an AMX Xeon with 2 threads: a 1728-wide inner dimension
below ~300 rows), so the row count is *probed* per weight shape, dtype and thread count
(:func:`min_rows`: the first of :data:`PROBE_ROWS` that holds), never below
:data:`MIN_ROWS`. A sequence of
two tokens scored alone therefore differed from the same sequence inside a pack by one
ulp. Padding every matmul to at least 64 rows keeps every call on the blocked path; above
that, a row's bits do not depend on the row count (checked for every count from 64 to 256
and around 512 and 1088 against a larger call, float32 and bfloat16, 1 to 16 threads, on
the shapes of tiny, bench and an 8B model; ``tests/unit/test_batch_invariant.py`` checks
it on the machine that runs the tests). Padding to a *multiple* of 64, as an earlier
version did, cost a small step up to 63 rows per matmul: a step of 68 rows computed 128.

The MLP's activation (SiLU / GELU, of the dense MLPs, shared experts and experts alike)
is elementwise, but not batch-invariant as torch runs it: a vectorised loop (SLEEF's
``exp``) covers all but the last elements of each thread's share of the tensor, which
take the scalar ``std::exp``, one ulp apart, and where the shares end depends on the
tensor's size. Measured on an AVX-512 CPU with 2 threads: one row of a Qwen3-MoE expert
in a 17k-token pack differed from the same sequence alone. :func:`_invariant_activation`
runs it on a flat copy of the tensor, zero-padded so that every thread's share is a
multiple of :data:`_VECTOR_ELEMENTS`: torch splits a flat tensor of ``N`` elements over
``min(threads, ceil(N / grain))`` threads in equal shares (``at::parallel_for``; GELU
takes ``N / threads`` as its grain), so with ``N`` a multiple of ``64 * threads`` and at
least ``threads`` grains every element takes the vectorised path, on any number of
threads (``tests/unit/test_batch_invariant.py`` checks 1 to 4). SiLU and GELU then run in
place on that copy, so the wrapper costs one copy of the input beside what the plain
activation costs (measured: on par with it on the shapes of ``tiny`` and ``bench``;
running it in one-thread blocks instead cost 7x the activation's time on ``tiny``).

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
import logging

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.router import TopKRouter

logger = logging.getLogger(__name__)

MIN_ROWS = 64
"""Every token-axis matmul runs on at least this many rows (zero rows appended)."""


_MARK = "_megascore_batch_invariant"
_VECTOR_ELEMENTS = 64
"""A multiple of the elements one step of torch's vectorised CPU loop takes (2 vectors of
16 float32 with AVX-512, 32 bfloat16)."""
_GRAIN_ELEMENTS = 1 << 15
"""torch's grain size (``at::internal::GRAIN_SIZE``): fewer elements run on one thread."""


def is_batch_invariant(module: torch.nn.Module) -> bool:
    """Whether :func:`make_batch_invariant` changed ``module``."""
    return getattr(module, _MARK, False)


PROBE_ROWS = (MIN_ROWS, 128, 256, 512, 1024)
"""The row counts :func:`min_rows` tries, smallest first (the last is taken when none holds)."""
_PROBED: dict[tuple, int] = {}


def min_rows(weight: torch.Tensor) -> int:
    """The row count from which a row of ``x @ weight.T`` has the same bits in any larger
    call, on this machine's BLAS at this thread count: probed once per weight shape,
    dtype and thread count (module docstring); :data:`MIN_ROWS` off the CPU."""
    key = (tuple(weight.shape), weight.dtype, weight.device.type, torch.get_num_threads())
    if key not in _PROBED:
        _PROBED[key] = _probe(*key[:3]) if weight.device.type == "cpu" else MIN_ROWS
        if _PROBED[key] > MIN_ROWS:
            logger.info("batch invariance: matmuls of weight %s (%s, %d threads) padded to "
                        "%d rows", key[0], key[1], key[3], _PROBED[key])  # fmt: skip
    return _PROBED[key]


def _probe(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> int:
    """The first of :data:`PROBE_ROWS` from which every sampled row count gives a random
    input's rows the bits they have in a call of ``2 * PROBE_ROWS[-1] + 3`` rows."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=gen).to(dtype)
    x = torch.randn(2 * PROBE_ROWS[-1] + 3, shape[-1], generator=gen).to(dtype)
    whole = F.linear(x, weight)
    for i, rows in enumerate(PROBE_ROWS):
        samples = {rows, rows + 1, rows + rows // 2 + 1, 2 * rows - 1, *PROBE_ROWS[i + 1 :]}
        if all(torch.equal(F.linear(x[:m], weight), whole[:m]) for m in sorted(samples)):
            return rows
    logger.warning(
        "batch invariance: matmuls of weight %s (%s) depend on the row count up to %d rows "
        "and beyond on this machine",
        shape,
        dtype,
        PROBE_ROWS[-1],
    )
    return PROBE_ROWS[-1]


def pad_rows(x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` with zero rows appended along dim 0 up to the rows from which a matmul with
    ``weight`` is row-invariant here (:func:`min_rows`; no weight: :data:`MIN_ROWS`). No
    rows: ``x`` as it is, there is no row to round differently; an expert that got no
    token then costs no matmul."""
    least = MIN_ROWS if weight is None else min_rows(weight)
    extra = least - x.shape[0] if x.shape[0] else 0
    if extra <= 0:
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
        input=pad_rows(input, weight),
        weight=weight,
        bias=bias,
        sequence_parallel=False,
        tp_group=tp_group,
        **kwargs,
    )
    return out[:rows]


def _router_gating(original, router, input: torch.Tensor) -> torch.Tensor:
    """``TopKRouter.gating`` on row-padded input (``[tokens, hidden]``)."""
    rows = input.shape[0]
    return original(pad_rows(input, router.weight))[:rows]


_IN_PLACE = {F.silu: torch.ops.aten.silu_, F.gelu: torch.ops.aten.gelu_}


def _invariant_activation(activation):
    """``activation`` (elementwise) computed the same way for every element, whatever the
    tensor's size: see the module docstring."""
    if getattr(activation, _MARK, False):
        return activation

    def run(x: torch.Tensor) -> torch.Tensor:
        size, threads = x.numel(), torch.get_num_threads()
        if not size:
            return activation(x)
        share = _VECTOR_ELEMENTS * threads
        padded = max(-(-size // share) * share, _GRAIN_ELEMENTS * threads if threads > 1 else 0)
        flat = x.new_empty(padded)
        flat[:size].view(x.shape).copy_(x)
        flat[size:].zero_()
        in_place = _IN_PLACE.get(activation)  # the copy is ours: no second allocation
        out = in_place(flat) if in_place is not None else activation(flat)
        return out[:size].view(x.shape)

    setattr(run, _MARK, True)
    return run


def make_batch_invariant(model: torch.nn.Module) -> int:
    """Pads the rows of every token-axis matmul of ``model`` and runs its MLP activations
    on padded flat copies (in place, idempotent).

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
            module.gating = functools.partial(_router_gating, module.gating, module)
        elif isinstance(module, MLP):  # the gated path reads the config's activation
            module.activation_func = _invariant_activation(module.activation_func)
            module.config.activation_func = _invariant_activation(module.config.activation_func)
        else:
            continue
        setattr(module, _MARK, True)
        changed += 1
    return changed

"""What batch invariance relies on (``megascore.model.batch_invariant``): the MLP
activation gives a row the same bits in a tensor of any size, and so does a matmul from
the row count probed for its weight on (at least ``MIN_ROWS``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megascore.model.batch_invariant import (
    MIN_ROWS,
    PROBE_ROWS,
    _invariant_activation,
    min_rows,
    pad_rows,
)


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_a_row_activates_the_same_in_tensors_of_any_size(threads):
    """The rows of every tensor, 1 to 4,000 rows of 32 or 40 columns (a gated MLP's half:
    a strided view, as Megatron's ``glu`` passes it), equal the rows of one large tensor
    bit for bit, on 1 to 4 threads; values match plain SiLU / GELU within float32
    rounding."""
    torch.manual_seed(0)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for columns in (32, 40):
            whole = torch.randn(4099, 2 * columns) * 4
            for activation in (F.silu, F.gelu):
                invariant = _invariant_activation(activation)
                reference = invariant(whole.chunk(2, dim=-1)[0])
                torch.testing.assert_close(reference, activation(whole.chunk(2, dim=-1)[0]))
                for rows in (1, 7, 64, 333, 1025, 2049, 4000):
                    start = int(torch.randint(0, 4099 - rows + 1, ()))
                    part = whole[start : start + rows].chunk(2, dim=-1)[0]
                    got = invariant(part)
                    assert torch.equal(got, reference[start : start + rows]), (columns, rows)
    finally:
        torch.set_num_threads(saved)


def test_shapes_dtypes_and_empty_tensors_pass_through():
    invariant = _invariant_activation(F.silu)
    assert _invariant_activation(invariant) is invariant
    empty = torch.empty(0, 1, 32)
    assert invariant(empty).shape == (0, 1, 32)
    x = torch.randn(5, 1, 48, dtype=torch.bfloat16)
    out = invariant(x)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.silu(x))


SHAPES = {  # (inner, outer) of tiny, its experts and bench
    torch.float32: ((64, 128), (32, 64), (64, 4), (640, 1280), (1728, 640)),
    # bench's in bfloat16 are not row-invariant here at any padding tried (docs/engine.md)
    torch.bfloat16: ((64, 128), (32, 64), (64, 4)),
}


def test_a_row_of_a_matmul_from_its_probed_row_count_on_does_not_depend_on_the_row_count():
    """What padding relies on, on this machine's BLAS: from the row count
    :func:`min_rows` probed for a weight on, a row of ``x @ W.T`` equals the same row in a
    larger call, bit for bit, at every row count tried here (more than the probe tries,
    up to 4,200 rows; 1 and 2 threads). On machines whose BLAS splits small calls
    otherwise (an AVX-512 / AMX Xeon with 2 threads: bench's float32 down projection below
    ~300 rows) the probe gives more than 64."""
    torch.manual_seed(0)
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for dtype, shapes in SHAPES.items():
                for inner, outer in shapes:
                    weight = torch.randn(outer, inner, dtype=dtype)
                    least = min_rows(weight)
                    assert MIN_ROWS <= least <= PROBE_ROWS[-1]
                    x = torch.randn(4200, inner, dtype=dtype)
                    whole = F.linear(x, weight)
                    for rows in range(least, 4200, 97):
                        got = F.linear(x[:rows], weight)
                        assert torch.equal(got, whole[:rows]), (threads, dtype, inner, rows)
                    padded = F.linear(pad_rows(x[:5], weight), weight)[:5]
                    assert torch.equal(padded, whole[:5])
    finally:
        torch.set_num_threads(saved)

"""The MLP activation of a batch-invariant model: a row's values do not depend on the
size of the tensor it is in (``megascore.model.batch_invariant._invariant_activation``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megascore.model.batch_invariant import _invariant_activation


def test_a_row_activates_the_same_in_tensors_of_any_size():
    """The rows of every tensor, 1 to 4,000 rows of 32 columns (a gated MLP's half: a
    strided view, as Megatron's ``glu`` passes it), equal the rows of one large tensor
    bit for bit, with every thread torch has; values match plain SiLU / GELU within
    float32 rounding."""
    torch.manual_seed(0)
    whole = torch.randn(4099, 64) * 4
    for activation in (F.silu, F.gelu):
        invariant = _invariant_activation(activation)
        reference = invariant(whole.chunk(2, dim=-1)[0])
        torch.testing.assert_close(reference, activation(whole.chunk(2, dim=-1)[0]))
        for rows in (1, 7, 64, 333, 1025, 2049, 4000):
            start = int(torch.randint(0, 4099 - rows + 1, ()))
            part = whole[start : start + rows].chunk(2, dim=-1)[0]
            assert torch.equal(invariant(part), reference[start : start + rows]), rows


def test_shapes_dtypes_and_empty_tensors_pass_through():
    invariant = _invariant_activation(F.silu)
    assert _invariant_activation(invariant) is invariant
    empty = torch.empty(0, 1, 32)
    assert invariant(empty).shape == (0, 1, 32)
    x = torch.randn(5, 1, 48, dtype=torch.bfloat16)
    out = invariant(x)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.silu(x))

"""Block-scaled FP8 checkpoints (DeepSeek-V3 / R1 layout), dequantised on load.

DeepSeek publishes its weights with ``"quantization_config": {"quant_method": "fp8",
"fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}`` in
``config.json``: every quantised matrix ``X.weight`` is stored as ``F8_E4M3``
``[rows, cols]`` next to ``X.weight_scale_inv`` (float) ``[ceil(rows / 128),
ceil(cols / 128)]``, one factor per 128 x 128 block; the real weight is
``fp8 * scale_inv`` of its block (the last block of a row or column may be partial).
Norms, embeddings, the output layer and the router stay in bf16.

megascore serves such a checkpoint in the serving dtype: :func:`block_size` reads the
config (torch-free, so ``hf_config`` refuses other quantisation methods up front);
:func:`dequantize` turns the rows / columns one rank reads into real values
(``megascore.checkpoint.safetensors_io`` reads only that slice of the FP8 tensor and of
its scales). Activations are not quantised (``activation_scheme`` is ignored: the
model computes in its serving dtype, as Megatron's bf16 trainer does).
"""

from __future__ import annotations

from typing import Any

from megascore.api.errors import CheckpointError

SCALE_SUFFIX = "_scale_inv"
"""``X.weight`` -> ``X.weight_scale_inv``: the per-block factors of an FP8 tensor."""
FP8_DTYPES = ("F8_E4M3",)


def block_size(config: dict[str, Any]) -> tuple[int, int] | None:
    """The FP8 block of a HF ``config.json`` (None: not quantised).

    Args:
        config: the parsed ``config.json``.

    Returns:
        ``(rows, cols)`` of one scaling block, or None without ``quantization_config``.

    Raises:
        CheckpointError: a quantisation megascore cannot dequantise (another
            ``quant_method`` or ``fmt``, or a malformed ``weight_block_size``), naming
            the field.
    """
    quant = config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise CheckpointError("config.json: quantization_config must be an object")
    method = quant.get("quant_method")
    if method != "fp8":
        raise CheckpointError(
            f"config.json: quantization_config.quant_method {method!r} is not supported "
            "(only DeepSeek's block-scaled 'fp8')"
        )
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(
            f"config.json: quantization_config.fmt {fmt!r} is not supported (only 'e4m3')"
        )
    block = quant.get("weight_block_size")
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise CheckpointError(
            "config.json: quantization_config.weight_block_size must be two positive "
            f"integers, got {block!r}"
        )
    return int(block[0]), int(block[1])


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The ``weight_scale_inv`` shape of an FP8 tensor of ``shape`` (2-D, or stacked)."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def scale_index(
    index: tuple[slice, ...], block: tuple[int, int]
) -> tuple[tuple[slice, ...], tuple[int, int]]:
    """The blocks of ``weight_scale_inv`` covering a slice of its FP8 tensor.

    Args:
        index: one step-1 slice with explicit bounds per dim of the FP8 tensor.
        block: the block size.

    Returns:
        ``(slices of the scale tensor, (row offset, column offset) of the FP8 slice
        inside the first covered block)``.
    """
    *lead, rows, cols = index
    out = (
        *lead,
        slice(rows.start // block[0], -(-rows.stop // block[0])),
        slice(cols.start // block[1], -(-cols.stop // block[1])),
    )
    return out, (rows.start % block[0], cols.start % block[1])


def dequantize(values, scales, block: tuple[int, int], offset: tuple[int, int] = (0, 0)):
    """``values * scale_inv`` of their blocks, in float32.

    Args:
        values: ``[..., r, c]`` FP8 tensor (a slice of the stored one).
        scales: ``[..., R, C]`` the scale blocks covering it (:func:`scale_index`).
        block: the block size.
        offset: where ``values`` starts inside the first covered block.

    Returns:
        The float32 weights ``[..., r, c]``.
    """
    rows, cols = values.shape[-2:]
    expanded = scales.float().repeat_interleave(block[0], dim=-2)
    expanded = expanded.repeat_interleave(block[1], dim=-1)
    expanded = expanded[..., offset[0] : offset[0] + rows, offset[1] : offset[1] + cols]
    return values.float() * expanded

"""Buffers the output head reuses from chunk to chunk and from step to step.

The head's vocabulary-wide tensors (one chunk's logits, the exp pass, the
temperature-scaled copy: ``chunk_tokens x V/tp`` each) are the largest a step
allocates. Allocated afresh, on the CPU each is handed back to the OS when freed and
page-faulted and zeroed by the kernel again for the next chunk: measured for a
``[1024, 256] x [256, 32000]`` logits matmul, writing into a reused buffer took 0.64x
the time of a new output (docs/engine.md, "Memory: the head's buffers"). The buffers
live as long as the output layer (:func:`megascore.engine.outputs.output_head.head_scratch`); one
engine thread uses them, one step at a time.
"""

from __future__ import annotations

import torch


class Scratch:
    """Named 2-D buffers, grown on demand and reused (the engine thread only)."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def take(
        self, name: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        """An uninitialised ``[rows, cols]`` view of buffer ``name``: its first rows.

        The buffer is replaced (not kept beside) when it has fewer rows, another width,
        dtype or device. A view taken earlier under the same name shares its memory.
        """
        device = torch.device(device)
        buf = self._buffers.get(name)
        if (
            buf is None
            or (buf.shape[1], buf.dtype, buf.device) != (cols, dtype, device)
            or (buf.shape[0] < rows)
        ):
            self._buffers.pop(name, None)  # freed before the new one is allocated
            buf = torch.empty(rows, cols, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:rows]

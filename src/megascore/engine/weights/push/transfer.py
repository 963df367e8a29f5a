"""A pushed tensor's parts, point to point: after a WEIGHTS_TENSOR header
(:mod:`megascore.engine.ranks.protocol`) rank 0 sends each rank only the parts of the tensor
that rank reads (which parts: :mod:`megascore.engine.weights.push.apply`), one flat message per
rank; nothing is broadcast.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist


def send_parts(parts: dict[int, list[torch.Tensor]], group: dist.ProcessGroup) -> int:
    """Rank 0, after a WEIGHTS_TENSOR header: sends each rank its parts of the tensor,
    one flat message per rank that reads any (point to point, all at once).

    Args:
        parts: global rank -> the tensors it reads, in the order it expects them
            (views of the pushed tensor; each is copied into the message).
        group: the group the header went to.

    Returns:
        The bytes sent.
    """
    sent, works = 0, []
    for rank, tensors in parts.items():
        flat = _flat_bytes(tensors)
        if flat.numel():
            works.append(dist.isend(flat, dst=rank, group=group))
            sent += flat.numel()
    for work in works:
        work.wait()
    return sent


def recv_parts(
    shapes: list[torch.Size], dtype: torch.dtype, src: int, group: dist.ProcessGroup
) -> list[torch.Tensor]:
    """A worker, after a WEIGHTS_TENSOR header: its parts of the tensor from ``src``
    (:func:`send_parts`), of the given shapes (nothing is received when they hold no
    element)."""
    sizes = [int(np.prod(shape)) for shape in shapes]
    flat = torch.empty(sum(sizes), dtype=dtype)
    if flat.numel():
        dist.recv(flat.view(torch.uint8), src=src, group=group)
    return [p.view(shape) for p, shape in zip(flat.split(sizes), shapes, strict=True)]


def _flat_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' elements, one after the other, as one contiguous uint8 tensor."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0]
    return flat.contiguous().view(-1).view(torch.uint8)

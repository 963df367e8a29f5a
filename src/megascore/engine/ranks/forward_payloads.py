"""A FORWARD's payloads after its ids and lengths, as a worker receives them
(:mod:`megascore.engine.ranks.protocol`): each input the flags announce, then, with flag
``CACHE_FLAG``, the prefix-cache plan: int64 ``[B + 2]`` (each sequence's cached tokens,
then the number of slots ``S`` and of moves ``M``), int64 ``[S]`` (the slot of every block
of every sequence: :mod:`megascore.engine.cache.store`) and, when ``M`` > 0, int64
``[2 M]`` (the moves between the cache's tiers, ``(from, to)`` pairs)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from megascore.api.types import ScoreBatch

_TORCH_DTYPES = {
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
    "float32": torch.float32,
    "float64": torch.float64,
}

Bcast = Callable[[torch.Tensor], None]


def receive_input(spec, shape: tuple[int, ...], bcast: Bcast, device) -> np.ndarray:
    """One input (``schema.INPUTS`` entry ``spec``) of ``shape``, through ``bcast``."""
    buffer = torch.empty(int(np.prod(shape)), dtype=_TORCH_DTYPES[spec.dtype], device=device)
    bcast(buffer)
    return buffer.cpu().numpy().reshape(shape)


def cache_plan(batch: ScoreBatch) -> list[np.ndarray]:
    """Rank 0: the plan's buffers."""
    moves = np.zeros((0, 2), np.int64) if batch.cache_moves is None else batch.cache_moves
    counts = [len(batch.cache_slots), len(moves)]
    buffers = [
        np.concatenate([batch.cache_hits, counts]).astype(np.int64),
        np.asarray(batch.cache_slots, dtype=np.int64),
    ]
    return buffers + ([np.asarray(moves, np.int64).reshape(-1)] if len(moves) else [])


def receive_cache_plan(
    num_sequences: int, bcast: Bcast, device
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A worker: ``(cache_hits [B], cache_slots [S], cache_moves [M, 2])`` through
    ``bcast``.

    Raises:
        ValueError: a negative count (the ranks are out of step).
    """
    head = torch.empty(num_sequences + 2, dtype=torch.int64, device=device)
    bcast(head)
    head = head.cpu().numpy()
    slots, moves = int(head[-2]), int(head[-1])
    if slots < 0 or moves < 0:
        raise ValueError(f"negative cache plan counts {slots}, {moves}")
    buffers = []
    for size, sent in ((slots, True), (2 * moves, moves > 0)):  # as cache_plan sends them
        buffer = torch.empty(size, dtype=torch.int64, device=device)
        if sent:
            bcast(buffer)
        buffers.append(buffer.cpu().numpy())
    return head[:-2].copy(), buffers[0], buffers[1].reshape(-1, 2)

"""A FORWARD's payloads after its ids and lengths, as a worker receives them
(:mod:`megascore.engine.ranks.protocol`): each input the flags announce, then, with flag
``CACHE_FLAG``, the prefix-cache plan: int64 ``[B + 1]`` (each sequence's cached tokens,
then the number of slots ``S``) and int64 ``[S]`` (the slot of every block of every
sequence: :mod:`megascore.engine.cache.store`)."""

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
    """Rank 0: the plan's two buffers."""
    count = [len(batch.cache_slots)]
    return [
        np.concatenate([batch.cache_hits, count]).astype(np.int64),
        np.asarray(batch.cache_slots, dtype=np.int64),
    ]


def receive_cache_plan(num_sequences: int, bcast: Bcast, device) -> tuple[np.ndarray, np.ndarray]:
    """A worker: ``(cache_hits [B], cache_slots [S])`` through ``bcast``.

    Raises:
        ValueError: a negative slot count (the ranks are out of step).
    """
    head = torch.empty(num_sequences + 1, dtype=torch.int64, device=device)
    bcast(head)
    hits = head.cpu().numpy()
    if hits[-1] < 0:
        raise ValueError(f"negative cache slot count {hits[-1]}")
    slots = torch.empty(int(hits[-1]), dtype=torch.int64, device=device)
    bcast(slots)
    return hits[:-1].copy(), slots.cpu().numpy()

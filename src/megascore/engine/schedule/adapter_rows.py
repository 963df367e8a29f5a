"""The LoRA adapter of every packed row of a step (docs/engine.md "LoRA adapters").

A step's sequences carry their adapter slot in the input ``adapter`` (-1: the weight set
alone; :mod:`megascore.engine.weights.adapters`). Tokens of different adapters never share
a row (:func:`adapter_keys` joins the step's token keys, so a shared prefix is shared only
by sequences of one adapter); each microbatch's per-row index is then its segments' slots
over the packing of this rank (:func:`megascore.model.lora.sequence_rows`), which the
forward step applies on every pipeline stage (``megascore.engine.schedule.pipeline``).
"""

from __future__ import annotations

import numpy as np
import torch

from megascore.model.lora import sequence_rows


def adapter_keys(batch) -> np.ndarray | None:
    """int64 ``[T, 1]``: the adapter slot of each token's sequence (None: no adapters)."""
    if batch.adapter is None:
        return None
    slots = np.asarray(batch.adapter, dtype=np.int64)
    return np.repeat(slots, np.asarray(batch.lengths, dtype=np.int64))[:, None]


def set_adapter_rows(batch, microbatches, layouts) -> None:
    """Each microbatch's ``adapter_rows``: the slot of every row this rank packs (its
    segments' sequences' slots, a padding segment's rows -1)."""
    slots = np.asarray(batch.adapter, dtype=np.int64)
    for mb, segments in zip(microbatches, layouts, strict=True):
        per_segment = slots[segments.sequences[segments.segments.sequences]]
        mb.adapter_rows = sequence_rows(
            torch.from_numpy(per_segment), mb.packed.cu_seqlens_padded, mb.packed.shard_indices
        )

"""Padded ``[B, S]`` test batches -> the flat ids that ``pack_sequences`` takes."""

from __future__ import annotations

import torch

from megascore.engine.layout.packing import PackedSequences, pack_sequences


def flatten_rows(rows: torch.Tensor, lengths) -> torch.Tensor:
    """``[B, S]`` rows holding ``lengths[b]`` real tokens first -> ``[T]`` concatenated."""
    return torch.cat([rows[b, : int(n)] for b, n in enumerate(lengths)])


def pack_rows(rows: torch.Tensor, lengths, **kwargs) -> PackedSequences:
    """``pack_sequences`` of a padded batch (same keyword arguments)."""
    return pack_sequences(flatten_rows(rows, lengths), lengths, **kwargs)

"""The parts of pushed tensors each rank reads (weight pushes, :mod:`.apply`).

A part is a basic index of a tensor (an int or a step-1 slice per leading dimension),
kept as a hashable, JSON-able key (:func:`part_key`: a slice as ``(start, stop)``; ``()``
the whole tensor). :class:`Recorder` finds the parts a rank's recipes read (a dry run
on ``meta`` tensors); :class:`Parts` is the reader its recipes then cut their shards
through, over the parts it received (or, on the sending rank, the whole tensors);
:func:`block_keys` gives Megatron's split of a full tensor as parts;
:func:`all_gather_json` shares each rank's lists.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

Index = tuple[int | slice, ...]
"""A part of a tensor: basic indexing, an int or a step-1 slice per leading dimension."""


def part_key(index: Index) -> tuple:
    """``index`` as a hashable, JSON-able value (a slice as ``(start, stop)``)."""
    return tuple(i if isinstance(i, int) else (i.start, i.stop) for i in index)


def part_index(key: tuple) -> Index:
    """The index a :func:`part_key` stands for."""
    return tuple(i if isinstance(i, int) else slice(*i) for i in key)


class Parts:
    """The reader interface recipes cut shards through, over the pushed tensors' parts
    this rank has: ``name -> {key: tensor}``; the key ``()`` is a whole tensor (rank 0)
    from which any part is a view."""

    directory = "the pushed weights"

    def __init__(self):
        self.tensors: dict[str, dict[tuple, torch.Tensor]] = {}

    def read(self, name: str, index: Index = ()) -> torch.Tensor:
        parts = self.tensors[name]
        wanted = part_key(index)
        return parts[wanted] if wanted in parts else parts[()][index]

    def read_into(self, name: str, out: torch.Tensor, index: Index = ()) -> None:
        out.copy_(self.read(name, index))


class Recorder:
    """A reader that reads nothing: it records the parts a recipe asks for (a dry run
    on ``meta`` tensors, ``WeightStaging``)."""

    directory = "the pushed weights"

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes = shapes
        self.reads: dict[str, dict[tuple, None]] = {}

    def read(self, name: str, index: Index = ()) -> torch.Tensor:
        self.reads.setdefault(name, {})[part_key(index)] = None
        return torch.empty(self.shapes[name], device="meta")[index]

    def read_into(self, name: str, out: torch.Tensor, index: Index = ()) -> None:
        self.read(name, index)


def block_keys(dim: int | None, stride: int, rank: int, size: int, shape) -> list[tuple]:
    """The parts of a full Megatron tensor that ``rank``'s shard is made of
    (:func:`megascore.model.weights.shard_full_tensor`): ``stride`` blocks of ``dim``
    (the whole tensor when it is not split)."""
    if dim is None or size == 1:
        return [()]
    block = shape[dim] // size // stride
    lead = tuple((0, n) for n in shape[:dim])
    return [(*lead, (b * block, (b + 1) * block)) for b in range(rank, size * stride, size)]


def all_gather_json(value, group) -> list:
    """Every rank's JSON-able ``value``, in group order (collective over ``group``; sent
    as UTF-8 JSON, never pickled)."""
    payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return [
        json.loads(p[: int(n.item())].numpy().tobytes()) for p, n in zip(parts, sizes, strict=True)
    ]

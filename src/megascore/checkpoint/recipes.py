"""Recipes: how one rank's shard of a Megatron parameter is cut out of HF tensors.

A :class:`Src` is a logical view of one HF tensor (optionally one expert of a
stacked ``[E, ...]`` tensor, or a row range of it). A :class:`Recipe` combines
sources into this rank's local tensor, reading only the rows/columns it needs.
Recipes validate against the file headers first (:meth:`Recipe.validate`), so
shape errors surface before any data is read.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from megascore.api.errors import CheckpointError
from megascore.checkpoint.safetensors_io import SafetensorsDir


def _group_rank_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


@dataclasses.dataclass(frozen=True)
class ParallelRanks:
    """This rank's coordinates in the groups that shard parameters."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    """Rank in the expert tensor-parallel group (splits each expert)."""
    etp_size: int = 1

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> ParallelRanks:
        """Reads the groups from the model's ``pg_collection`` (Megatron >= 0.14)."""
        pgs = getattr(model, "pg_collection", None)
        if pgs is None or not torch.distributed.is_initialized():
            return cls()
        tp = _group_rank_size(getattr(pgs, "tp", None))
        ep = _group_rank_size(getattr(pgs, "ep", None))
        etp = _group_rank_size(getattr(pgs, "expt_tp", None))
        return cls(tp[0], tp[1], ep[0], ep[1], etp[0], etp[1])


@dataclasses.dataclass(frozen=True)
class Src:
    """A 1-D or 2-D logical view of an HF tensor.

    Attributes:
        name: tensor name in the checkpoint.
        shape: logical shape (what the architecture implies).
        lead: fixed leading indices (expert index of a stacked tensor).
        row0: first row of the view along the first non-lead dim.
        full: expected shape of the whole stored tensor (default ``shape``).
    """

    name: str
    shape: tuple[int, ...]
    lead: tuple[int, ...] = ()
    row0: int = 0
    full: tuple[int, ...] | None = None

    def validate(self, reader: SafetensorsDir) -> None:
        """Raises unless the checkpoint holds the tensor with the shape its config implies."""
        want = self.full or self.shape
        got = reader.shape(self.name)  # raises for a missing tensor
        if got != want:
            raise CheckpointError(
                f"{reader.file(self.name)}: tensor {self.name!r} has shape {list(got)}, "
                f"expected {list(want)} from the architecture in config.json"
            )

    def rows(self, reader: SafetensorsDir, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of the view (all columns)."""
        index = (*(slice(i, i + 1) for i in self.lead), slice(self.row0 + start, self.row0 + stop))
        out = reader.read(self.name, index)
        return out.reshape(out.shape[len(self.lead) :])

    def cols(self, reader: SafetensorsDir, start: int, stop: int) -> torch.Tensor:
        """Columns ``[start, stop)`` of a 2-D view (all rows)."""
        index = (
            *(slice(i, i + 1) for i in self.lead),
            slice(self.row0, self.row0 + self.shape[0]),
            slice(start, stop),
        )
        out = reader.read(self.name, index)
        return out.reshape(out.shape[len(self.lead) :])

    def all(self, reader: SafetensorsDir) -> torch.Tensor:
        return self.rows(reader, 0, self.shape[0])

    def rows_into(self, reader: SafetensorsDir, start: int, stop: int, out: torch.Tensor) -> None:
        """Writes rows ``[start, stop)`` of the view into ``out`` (straight from the file
        where it can: :meth:`SafetensorsDir.read_into`)."""
        index = (*self.lead, slice(self.row0 + start, self.row0 + stop))
        reader.read_into(self.name, out, index)

    def cols_into(self, reader: SafetensorsDir, start: int, stop: int, out: torch.Tensor) -> None:
        """Writes columns ``[start, stop)`` of a 2-D view into ``out`` (straight from the
        file when they are all its columns)."""
        rows = slice(self.row0, self.row0 + self.shape[0])
        reader.read_into(self.name, out, (*self.lead, rows, slice(start, stop)))


def _split(total: int, rank: int, size: int, what: str) -> tuple[int, int]:
    if total % size:
        raise CheckpointError(f"{what}: dimension {total} does not split over {size} ranks")
    per = total // size
    return rank * per, (rank + 1) * per


class Recipe(abc.ABC):
    """Produces this rank's tensor for one Megatron state-dict entry."""

    srcs: tuple[Src, ...]

    def sources(self) -> list[str]:
        return [s.name for s in self.srcs]

    def fit(self, target_shape: tuple[int, ...]) -> None:
        """Records the model's local shape (VocabRows adapts to vocabulary padding)."""
        self.target_shape = tuple(target_shape)

    def validate(self, reader: SafetensorsDir, param: str) -> None:
        """Checks every source exists with its expected shape (headers only)."""
        for s in self.srcs:
            s.validate(reader)

    @abc.abstractmethod
    def local_shape(self) -> tuple[int, ...]: ...

    @abc.abstractmethod
    def read(self, reader: SafetensorsDir) -> torch.Tensor: ...

    def read_into(self, reader: SafetensorsDir, out: torch.Tensor) -> None:
        """Writes this rank's tensor into ``out`` (the parameter; ``local_shape()``).
        Recipes whose pieces are row ranges read them into place, without a staging copy."""
        out.copy_(self.read(reader))


class Replicated(Recipe):
    """The whole tensor on every rank (norms, router)."""

    def __init__(self, src: Src):
        self.srcs = (src,)

    def local_shape(self):
        return self.srcs[0].shape

    def read(self, reader):
        return self.srcs[0].all(reader)

    def read_into(self, reader, out):
        self.srcs[0].rows_into(reader, 0, self.srcs[0].shape[0], out)


class Split(Recipe):
    """A contiguous 1/size of ``dim`` (0: column-parallel rows, 1: row-parallel columns)."""

    def __init__(self, src: Src, dim: int, rank: int, size: int):
        self.srcs, self.dim = (src,), dim
        self.start, self.stop = _split(src.shape[dim], rank, size, src.name)

    def local_shape(self):
        shape = list(self.srcs[0].shape)
        shape[self.dim] = self.stop - self.start
        return tuple(shape)

    def read(self, reader):
        src = self.srcs[0]
        if self.dim == 0:
            return src.rows(reader, self.start, self.stop)
        return src.cols(reader, self.start, self.stop)

    def read_into(self, reader, out):
        if self.dim == 0:
            self.srcs[0].rows_into(reader, self.start, self.stop, out)
        else:
            self.srcs[0].cols_into(reader, self.start, self.stop, out)


class VocabRows(Recipe):
    """Vocab-parallel rows; rows beyond the checkpoint vocabulary (padding) are zero."""

    def __init__(self, src: Src, rank: int, size: int):
        self.srcs, self.rank, self.size = (src,), rank, size
        self.per_rank = None

    def fit(self, target_shape):
        super().fit(target_shape)
        self.per_rank = target_shape[0]

    def validate(self, reader, param):
        super().validate(reader, param)
        vocab = self.srcs[0].shape[0]
        if self.per_rank is None or self.per_rank * self.size < vocab:
            raise CheckpointError(
                f"vocab mismatch: {param!r} holds {self.per_rank} rows x {self.size} ranks, "
                f"fewer than the checkpoint's {vocab}"
            )

    def local_shape(self):
        return (self.per_rank, *self.srcs[0].shape[1:])

    def read(self, reader):
        src, vocab = self.srcs[0], self.srcs[0].shape[0]
        start = self.rank * self.per_rank
        stop = min(start + self.per_rank, vocab)
        real = src.rows(reader, start, stop) if stop > start else None
        out = torch.zeros(self.local_shape(), dtype=real.dtype if real is not None else None)
        if real is not None:
            out[: stop - start] = real
        return out

    def read_into(self, reader, out):
        vocab = self.srcs[0].shape[0]
        start = self.rank * self.per_rank
        stop = min(start + self.per_rank, vocab)
        if stop > start:
            self.srcs[0].rows_into(reader, start, stop, out[: stop - start])
        out[max(stop - start, 0) :].zero_()


class QKV(Recipe):
    """Fused QKV: per local query group, its q heads then k then v (weight or bias)."""

    def __init__(self, q: Src, k: Src, v: Src, *, groups, heads, head_dim, rank, size):
        self.srcs = (q, k, v)
        self.g0, self.g1 = _split(groups, rank, size, f"{q.name} query groups")
        self.per_group = heads // groups
        self.d = head_dim

    def local_shape(self):
        q = self.srcs[0]
        return ((self.g1 - self.g0) * (self.per_group + 2) * self.d, *q.shape[1:])

    def read(self, reader):
        q, k, v = self.srcs
        n, hd = self.g1 - self.g0, self.per_group * self.d
        tail = q.shape[1:]
        # q: [n, heads_per_group * d, *tail]; k, v: [n, d, *tail]
        qs = q.rows(reader, self.g0 * hd, self.g1 * hd).reshape(n, hd, *tail)
        ks = k.rows(reader, self.g0 * self.d, self.g1 * self.d).reshape(n, self.d, *tail)
        vs = v.rows(reader, self.g0 * self.d, self.g1 * self.d).reshape(n, self.d, *tail)
        if not (qs.dtype == ks.dtype == vs.dtype):
            ks, vs = ks.to(qs.dtype), vs.to(qs.dtype)
        # fused: [n, (heads_per_group + 2) * d, *tail] -> [n * (hpg + 2) * d, *tail]
        return torch.cat([qs, ks, vs], dim=1).reshape(-1, *tail)

    def read_into(self, reader, out):
        q, k, v = self.srcs
        hd, d = self.per_group * self.d, self.d
        groups = out.view(self.g1 - self.g0, hd + 2 * d, *q.shape[1:])
        for i, g in enumerate(range(self.g0, self.g1)):
            q.rows_into(reader, g * hd, (g + 1) * hd, groups[i, :hd])
            k.rows_into(reader, g * d, (g + 1) * d, groups[i, hd : hd + d])
            v.rows_into(reader, g * d, (g + 1) * d, groups[i, hd + d :])


class GatedFC1(Recipe):
    """SwiGLU ``linear_fc1``: this rank's gate rows, then its up rows."""

    def __init__(self, gate: Src, up: Src, rank: int, size: int):
        self.srcs = (gate, up)
        self.start, self.stop = _split(gate.shape[0], rank, size, gate.name)

    def local_shape(self):
        return (2 * (self.stop - self.start), *self.srcs[0].shape[1:])

    def read(self, reader):
        gate, up = self.srcs
        g = gate.rows(reader, self.start, self.stop)
        u = up.rows(reader, self.start, self.stop).to(g.dtype)
        return torch.cat([g, u], dim=0)

    def read_into(self, reader, out):
        gate, up = self.srcs
        n = self.stop - self.start
        gate.rows_into(reader, self.start, self.stop, out[:n])
        up.rows_into(reader, self.start, self.stop, out[n:])


class RowsOrReplicated(Recipe):
    """A linear layer that a backend builds either column-parallel (this rank's rows) or
    replicated (TransformerEngine's ``duplicated`` MLA down-projections): the model's
    local shape decides (see :meth:`fit`)."""

    def __init__(self, src: Src, rank: int, size: int):
        self.srcs, self.rank, self.size = (src,), rank, size
        self.start, self.stop = 0, src.shape[0]

    def fit(self, target_shape):
        super().fit(target_shape)
        if tuple(target_shape) != self.srcs[0].shape:
            self.start, self.stop = _split(self.srcs[0].shape[0], self.rank, self.size, "rows")

    def local_shape(self):
        return (self.stop - self.start, *self.srcs[0].shape[1:])

    def read(self, reader):
        return self.srcs[0].rows(reader, self.start, self.stop)

    def read_into(self, reader, out):
        self.srcs[0].rows_into(reader, self.start, self.stop, out)

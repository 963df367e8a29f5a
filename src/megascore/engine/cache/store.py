"""Every rank's shard of the prefix cache: the keys and values of the cached blocks.

A *block* is ``block`` consecutive positions of a sequence, aligned at its start. Each
attention layer of this rank (``TorchCoreAttention.cache_index``) has a pool of
``num_slots`` blocks of its keys and of its values, shaped as the layer's own (its TP
heads, its PP stage's layers), allocated at start-up (``torch.empty``: on the CPU the
pages are taken as slots are written). Rank 0's index
(:mod:`megascore.engine.cache.index`) decides which slot holds which block; a step's batch
carries the decision (``ScoreBatch.cache_hits`` / ``cache_slots``) and
:func:`microbatch_cache` turns it into each microbatch's :class:`CacheView`, through which
every layer writes its rows of the new blocks and reads the cached ones.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from megascore.api import layout


class PrefixStore:
    """This rank's pools of cached keys and values.

    Args:
        num_slots: blocks a pool holds (rank 0's index hands out slots below it).
        block: positions per block.
        rows: per attention layer of this rank, the shape of one row of its keys and of
            its values (``(heads, dim)``: what the layer's attention sees).
        dtype: their dtype.
        device: where the pools live.
        host_slots: blocks of the host tier's pools (slots ``num_slots`` and up; pinned
            memory under CUDA): what the device pools evict goes there.
    """

    def __init__(self, num_slots: int, block: int, rows, dtype, device, host_slots: int = 0):
        self.num_slots = num_slots
        self.block = block
        device = torch.device(device)

        def pools(slots: int, where, pin: bool):
            # [slots, block, *row]: torch.empty, so on the CPU pages are taken as written
            return [
                tuple(
                    torch.empty((slots, block, *row), dtype=dtype, device=where, pin_memory=pin)
                    for row in kv
                )
                for kv in rows
            ]

        self._pools = pools(num_slots, device, False)
        self._host = pools(host_slots, "cpu", device.type == "cuda") if host_slots else []
        self.written: list[int] = []
        """Slots this rank wrote in the running step (:meth:`share_written`)."""

    def move(self, moves: np.ndarray) -> None:
        """Makes the moves between the tiers of a step's plan (``(from slot, to slot)``
        pairs, in order: a slot a move frees may be the next one's target)."""
        for src, dst in np.asarray(moves, np.int64).reshape(-1, 2):
            for layer in range(len(self._pools)):
                for kind in (0, 1):
                    self._slot(layer, kind, int(dst)).copy_(self._slot(layer, kind, int(src)))

    def _slot(self, layer: int, kind: int, slot: int) -> torch.Tensor:
        """Block ``slot`` of layer ``layer``'s keys (kind 0) or values (kind 1)."""
        if slot < self.num_slots:
            return self._pools[layer][kind][slot]
        return self._host[layer][kind][slot - self.num_slots]

    def pools(self, layer: int, key: torch.Tensor, value: torch.Tensor):
        """Layer ``layer``'s ``(keys, values)`` pools ``[num_slots, block, *row]``, checked
        against the layer's ``key`` / ``value`` (``[rows, heads, dim]``)."""
        pools = self._pools[layer]
        for pool, x in zip(pools, (key, value), strict=True):
            if pool.shape[2:] != x.shape[1:] or pool.dtype != x.dtype:
                raise ValueError(
                    f"prefix cache layer {layer}: pool rows {tuple(pool.shape[2:])} "
                    f"{pool.dtype}, the layer's {tuple(x.shape[1:])} {x.dtype}"
                )
        return pools

    def share_written(self, group) -> None:
        """Every rank of a data-parallel ``group`` after a step: the blocks each rank wrote
        go to every other rank's pools, so that any of them can read any cached block
        (the ranks of a group hold the same layers and head shards; rank 0's index is
        the one index of the replica)."""
        device = self._pools[0][0].device if self._pools else torch.device("cpu")
        mine, self.written = torch.tensor(self.written, dtype=torch.long, device=device), []
        size = dist.get_world_size(group)
        counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(size)]
        dist.all_gather(counts, torch.tensor([len(mine)], device=device), group=group)
        counts = [int(c) for c in counts]
        if not max(counts):
            return
        send = torch.zeros(max(counts), dtype=torch.long, device=device)  # padded: slot 0,
        send[: len(mine)] = mine  # never read back
        slots = [torch.empty_like(send) for _ in range(size)]
        dist.all_gather(slots, send, group=group)
        me = dist.get_rank(group)
        for pools in self._pools:
            for pool in pools:
                parts = [torch.empty_like(pool[send]) for _ in range(size)]
                dist.all_gather(parts, pool[send], group=group)
                for d, n in enumerate(counts):
                    if d != me and n:
                        pool[slots[d][:n]] = parts[d][:n]


@dataclasses.dataclass
class CacheView:
    """What one microbatch's attention layers write to and read from the store.

    Attributes:
        store: this rank's store.
        read_slots: int64 ``[R]`` the cached blocks the microbatch reads, in the order
            they follow the packed rows on the key axis.
        write_runs: ``(first packed row, rows)`` of each run of consecutive new blocks.
        write_rows: int64 ``[sum of the runs' rows]`` where their rows go in a pool seen
            as ``[num_slots * block, *row]`` (``slot * block + i``), run after run.
    """

    store: PrefixStore
    read_slots: torch.Tensor
    write_runs: tuple[tuple[int, int], ...]
    write_rows: torch.Tensor

    def extend(self, layer: int, key: torch.Tensor, value: torch.Tensor):
        """Writes layer ``layer``'s rows of the new blocks, then returns its keys and values
        ``[rows, heads, dim]`` with the cached blocks' rows after the packed ones."""
        pool_k, pool_v = self.store.pools(layer, key, value)
        done = 0
        for first, rows in self.write_runs:  # from views of the packed rows: no gather
            dest = self.write_rows[done : done + rows]
            pool_k.view(-1, *key.shape[1:]).index_copy_(0, dest, key[first : first + rows])
            pool_v.view(-1, *value.shape[1:]).index_copy_(0, dest, value[first : first + rows])
            done += rows
        if not len(self.read_slots):
            return key, value
        cached_k = pool_k[self.read_slots].reshape(-1, *key.shape[1:])
        cached_v = pool_v[self.read_slots].reshape(-1, *value.shape[1:])
        return torch.cat([key, cached_k]), torch.cat([value, cached_v])


def microbatch_cache(
    offsets: np.ndarray,
    lengths: np.ndarray,
    slots: list[np.ndarray],
    packed_rows: int,
    segment_starts: list[int],
    store: PrefixStore,
    device,
) -> tuple[list[torch.Tensor], CacheView]:
    """A microbatch's cached rows and :class:`CacheView` (dense segments, CP 1).

    Args:
        offsets: int64 ``[S]`` the microbatch's segments (one root per sequence, in
            packing order): the sequence's cached tokens (a multiple of the block).
        lengths: int64 ``[S]`` their tokens.
        slots: per segment, int64 ``[ceil(offset + length) / block]`` the slot of each
            block of its sequence: read below the offset, written from it (-1: not
            written; a block is written only where the segment holds all of it).
        packed_rows: rows of the packed microbatch (where the cached rows begin on the
            key axis).
        segment_starts: the packed row of each segment's first row.
        store: this rank's store.
        device: the model's device.

    Returns:
        ``(cached rows per segment, view)``.
    """
    block = store.block
    order: dict[int, int] = {}  # read slot -> its place after the packed rows
    cached_rows, runs, dest = [], [], []
    for s, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        offset, length, own = int(offset), int(length), slots[s]
        reads = [int(x) for x in own[: offset // block]]
        for slot in reads:
            order.setdefault(slot, len(order))
        cached_rows.append(
            torch.tensor(
                [packed_rows + order[slot] * block + i for slot in reads for i in range(block)],
                dtype=torch.long,
            )
        )
        for j in range(offset // block, len(own)):
            if own[j] >= 0 and (j + 1) * block <= offset + length:
                first = segment_starts[s] + j * block - offset
                if runs and sum(runs[-1]) == first:  # follows the run before it
                    runs[-1] = (runs[-1][0], runs[-1][1] + block)
                else:
                    runs.append((first, block))
                dest.append(int(own[j]) * block + np.arange(block))
                store.written.append(int(own[j]))
    view = CacheView(
        store=store,
        read_slots=torch.tensor(list(order), dtype=torch.long, device=device),
        write_runs=tuple(runs),
        write_rows=torch.from_numpy(np.concatenate(dest) if dest else np.zeros(0, np.int64)).to(
            device
        ),
    )
    return cached_rows, view


def sequence_slots(batch, store: PrefixStore | None) -> list[np.ndarray]:
    """Per sequence of a batch with a cache plan, the slot of each block of it
    (``ScoreBatch.cache_slots``: the blocks of ``cache_hits + length`` positions, sequence
    after sequence).

    Raises:
        ValueError: this rank has no store, or the plan's slots do not fit the batch.
    """
    if store is None:
        raise ValueError("the batch carries a cache plan, this replica has no prefix cache")
    full = np.asarray(batch.cache_hits, np.int64) + np.asarray(batch.lengths, np.int64)
    bounds = layout.offsets(-(-full // store.block))
    if int(bounds[-1]) != len(batch.cache_slots):
        raise ValueError(f"cache plan: {len(batch.cache_slots)} slots for {int(bounds[-1])} blocks")
    slots = np.asarray(batch.cache_slots)
    return [slots[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

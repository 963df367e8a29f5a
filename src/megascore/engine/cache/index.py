"""Rank 0's index of the prefix cache: which blocks are cached, in which slot, with which
outputs; what to evict (numpy, torch-free).

A block is keyed by a hash chain over the token ids (:func:`chain_keys`): block ``j``'s
key hashes block ``j - 1``'s key and the block's own tokens (block 0: a seed naming the
weights, e.g. the weight set and LoRA adapter with their versions), so a key names the
whole prefix up to the block's end under those weights, and a sequence's cached prefix
is its longest run of keys present from block 0 on.

Memory: every block holds one slot on every rank (its keys and values) and, on rank 0,
the outputs stored with it (:class:`BlockOutputs`); the two together stay within the
byte budget.

Eviction is a segmented LRU (:class:`PrefixIndex`): a new block enters the *probation*
segment; a block that is read (a hit) moves to the *protected* segment, which holds at
most ``protected_share`` of the slots (its least recently used block falls back to
probation). A block is evicted from the probation segment first, least recently used
first, and with it every block that continues it (they are unreachable without it).
One client's stream of new, never repeated prefixes therefore cycles through probation
and cannot push out prefixes that were hit; a turn's history stays for the next turn as
long as probation holds the newer prefixes that arrive meanwhile. Blocks a step reads are
pinned while it is planned (never evicted to make room for that step's new blocks); the
step runs before the next is planned, so a running step's blocks are never evicted.

A second tier (``host_slots`` > 0: ``--prefix-cache-host-gib``, pinned host memory under a
GPU) takes what the first evicts: the block moves to a host slot instead of being dropped
(its descendants stay where they are), and a block read from the host tier moves back to
a device slot before its step. The index records every move (``moves``: ``(from slot, to
slot)``, slots ``num_slots`` and up are the host's) and the next step's plan carries them;
every rank makes them, in order, before its forward
(:meth:`megascore.engine.cache.store.PrefixStore.move`). The host tier is an LRU of its
own; what it evicts is dropped, with every block that continues it.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np


def chain_keys(token_ids: np.ndarray, block: int, count: int, seed: bytes = b"") -> list[bytes]:
    """Keys of the first ``count`` full blocks of one sequence's ``token_ids``; ``seed``
    names the weights they are computed with (block 0 hashes it first: a weight set's or
    adapter's blocks are never another's)."""
    ids = np.ascontiguousarray(token_ids, dtype=np.int64)
    keys, key = [], seed
    for j in range(count):
        key = hashlib.blake2b(
            key + ids[j * block : (j + 1) * block].tobytes(), digest_size=16
        ).digest()
        keys.append(key)
    return keys


MAX_NEXT_TOKENS = 16
"""Next tokens a block keeps its last entry for (the continuations seen most recently)."""


@dataclasses.dataclass
class BlockOutputs:
    """The per-token outputs of one cached block, from the steps that computed it.

    Attributes:
        values: output name -> ``[block - 1, ...]``: the entries ``j * block + 1 ..
            (j + 1) * block - 1`` of block ``j``'s sequence (predicted by its rows).
        last: the next token ``t`` at ``(j + 1) * block`` (with the head inputs read
            there: ``megascore.engine.cache.planner``) -> output name -> the entry
            ``(j + 1) * block``: the block's last row predicting ``t`` (it depends on the
            token after the block, which continuations of the block do not share).
    """

    values: dict[str, np.ndarray]
    last: dict[bytes, dict[str, np.ndarray]] = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        entries = [*self.values.values(), *(v for x in self.last.values() for v in x.values())]
        return sum(v.nbytes for v in entries)

    def merge(self, newer: BlockOutputs) -> None:
        """Takes ``newer``'s next-token entries (the same block and options: the same
        ``values``), at most :data:`MAX_NEXT_TOKENS`, the newest kept."""
        for token, entry in newer.last.items():
            self.last.pop(token, None)
            self.last[token] = entry
        while len(self.last) > MAX_NEXT_TOKENS:
            del self.last[next(iter(self.last))]


@dataclasses.dataclass
class Block:
    """One cached block."""

    key: bytes
    parent: bytes | None
    slot: int
    outputs: dict[bytes, BlockOutputs] = dataclasses.field(default_factory=dict)
    children: set[bytes] = dataclasses.field(default_factory=set)


MAX_OUTPUT_SETS = 2
"""Output sets (by signature: temperature, top-k, ...) one block keeps, newest first."""


class PrefixIndex:
    """The blocks, their slots and the segmented LRU (module docstring).

    Args:
        num_slots: slots on every rank (the device tier).
        slot_bytes: bytes of one slot on the rank that holds the most per slot.
        budget_bytes: what the device slots in use plus the stored outputs may take.
        protected_share: the share of the slots the protected segment may hold.
        host_slots: slots of the host tier (0: none).
    """

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        budget_bytes: int,
        protected_share: float = 0.5,
        host_slots: int = 0,
    ):
        self.num_slots = num_slots
        self.host_slots = host_slots
        self.slot_bytes = slot_bytes
        self.budget_bytes = budget_bytes
        self.protected_cap = int(num_slots * protected_share)
        self.blocks: dict[bytes, Block] = {}
        self.output_bytes = 0
        self.evictions = 0
        self.demotions = 0
        self.promotions = 0
        self.clear()

    @property
    def stored_bytes(self) -> int:
        """Bytes the device tier's blocks take (their slots, on the largest rank; a slot
        handed out for a block its step has not committed yet counts) and every block's
        outputs."""
        device_slots = len(self.blocks) - len(self._host) + self._handed_out
        return device_slots * self.slot_bytes + self.output_bytes

    @property
    def host_bytes(self) -> int:
        """Bytes the host tier's blocks take."""
        return len(self._host) * self.slot_bytes

    def take_moves(self) -> list[tuple[int, int]]:
        """The moves recorded since the last call, in order (the next step makes them)."""
        moves, self.moves = self.moves, []
        return moves

    def promote(self, keys: list[bytes], pinned: set[bytes]) -> int:
        """Moves the blocks of a read chain that sit in the host tier to device slots;
        returns how many of ``keys`` are on the device from the first on (a block with
        no device slot to go to ends the run)."""
        for n, key in enumerate(keys):
            block = self.blocks[key]
            if block.slot < self.num_slots:
                continue
            slot = self.allocate(pinned | {key})
            if slot is None:
                return n
            self._handed_out -= 1  # filled by the move
            self.moves.append((block.slot, slot))
            del self._host[key]
            self._host_free.append(block.slot)
            block.slot = slot
            self._probation[key] = None
            self.promotions += 1
        return len(keys)

    def hits(self, keys: list[bytes]) -> int:
        """How many of ``keys`` (a sequence's chain) are cached from the first on."""
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        return n

    def touch(self, keys: list[bytes]) -> None:
        """Marks a read chain most recently used (the first block last: a block is never
        older than the blocks that continue it) and protects it."""
        for key in reversed(keys):
            self._probation.pop(key, None)
            self._protected.pop(key, None)
            self._protected[key] = None
        while len(self._protected) > self.protected_cap:
            key, _ = self._protected.popitem(last=False)
            self._probation[key] = None

    def allocate(self, pinned: set[bytes]) -> int | None:
        """A free slot, evicting the least recently used unpinned blocks as needed (and
        while the budget is exceeded); None when everything left is pinned."""
        while not self._free or self.stored_bytes + self.slot_bytes > self.budget_bytes:
            if not self._evict_one(pinned):
                return None
        self._handed_out += 1
        return self._free.pop()

    def release(self, slot: int) -> None:
        """Gives back a slot :meth:`allocate` handed out that holds no block."""
        self._handed_out -= 1
        self._free.append(slot)

    def insert(self, key: bytes, parent: bytes | None, slot: int) -> Block:
        """A new block in ``slot``, which :meth:`allocate` handed out (probation, most
        recently used)."""
        self._handed_out -= 1
        block = Block(key=key, parent=parent, slot=slot)
        self.blocks[key] = block
        if parent is not None:
            self.blocks[parent].children.add(key)
        self._probation[key] = None
        return block

    def add_outputs(self, key: bytes, signature: bytes, outputs: BlockOutputs, pinned) -> None:
        """Stores a block's outputs under ``signature`` (within the budget: evicts others
        first; drops them when that is not possible)."""
        block = self.blocks[key]
        old = block.outputs.pop(signature, None)
        if old is not None:
            self.output_bytes -= old.nbytes
            old.merge(outputs)
            outputs = old
        while self.stored_bytes + outputs.nbytes > self.budget_bytes:
            if not self._evict_one(pinned | {key}):
                return
        if len(block.outputs) >= MAX_OUTPUT_SETS:
            oldest = next(iter(block.outputs))
            self.output_bytes -= block.outputs.pop(oldest).nbytes
        block.outputs[signature] = outputs
        self.output_bytes += outputs.nbytes

    def clear(self) -> None:
        """Forgets every block (new weights: nothing cached holds)."""
        self.blocks.clear()
        self._probation: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._protected: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._host: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._host_free = list(range(self.num_slots + self.host_slots - 1, self.num_slots - 1, -1))
        self.moves: list[tuple[int, int]] = []
        self._handed_out = 0  # slots allocated whose blocks are not inserted yet
        self.output_bytes = 0

    def _evict_one(self, pinned: set[bytes]) -> bool:
        """Frees one device slot: the least recently used unpinned block moves to the host
        tier, or, without one, is dropped with its descendants."""
        for segment in (self._probation, self._protected):
            for key in segment:
                if key in pinned:
                    continue
                if self.host_slots:
                    return self._demote(key, pinned)
                if not self._pins_below(key, pinned):
                    self._evict(key)
                    return True
        return False

    def _demote(self, key: bytes, pinned: set[bytes]) -> bool:
        while not self._host_free:  # the host tier's least recently used, dropped
            victim = next(
                (k for k in self._host if k not in pinned and not self._pins_below(k, pinned)),
                None,
            )
            if victim is None:
                return False
            self._evict(victim)
        block, slot = self.blocks[key], self._host_free.pop()
        self.moves.append((block.slot, slot))
        self._free.append(block.slot)
        self._probation.pop(key, None)
        self._protected.pop(key, None)
        self._host[key] = None
        block.slot = slot
        self.demotions += 1
        return True

    def _pins_below(self, key: bytes, pinned: set[bytes]) -> bool:
        """Whether a block that continues ``key`` is pinned (evicting ``key`` evicts it)."""
        stack = list(self.blocks[key].children)
        while stack:
            child = stack.pop()
            if child in pinned:
                return True
            stack.extend(self.blocks[child].children)
        return False

    def _evict(self, key: bytes) -> None:
        block = self.blocks.pop(key)
        for child in list(block.children):
            self._evict(child)
        if block.parent is not None and block.parent in self.blocks:
            self.blocks[block.parent].children.discard(key)
        self._probation.pop(key, None)
        self._protected.pop(key, None)
        self.output_bytes -= sum(o.nbytes for o in block.outputs.values())
        if key in self._host:
            del self._host[key]
            self._host_free.append(block.slot)
        else:
            self._free.append(block.slot)
        self.evictions += 1

"""Rank 0's side of the prefix cache: each step's plan, the step on the uncached tails,
the outputs joined back (numpy, torch-free).

:meth:`PrefixCache.score` runs a batch as steps of the replica:

1. **Shared prefixes first.** Sequences of the batch that share a prefix the cache does
   not hold yet (aligned to the block, at least ``min_shared`` new tokens, one more
   token after it that they also share) get it computed once, in a step of its own
   whose sequences are those prefixes (recursively: prefixes they share in turn are
   computed before them). Within-step sharing is this same mechanism.
2. **The plan.** Per sequence, the longest run of cached blocks from its start, cut so
   that the sequence's last row is computed, and, where its outputs are asked for
   (``score_from``), to blocks that hold outputs stored under the same options
   (:func:`_signature`) and, for the last one, the same next token. New full blocks get
   slots. The batch sent to the ranks is the *tails*: every sequence from its first
   uncached token on, with ``cache_hits`` / ``cache_slots`` saying what each reads and
   writes (:mod:`megascore.engine.cache.store`).
3. **The outputs.** Each per-token output of the head is the stored entries of the
   cached blocks, then the tail's; the per-sequence outputs (losses, counts, mismatch
   statistics) are computed on the whole sequences
   (:func:`megascore.api.finish.finish_values`). The new blocks enter
   the index with their outputs only once the step succeeded.

A cached block's keys and values are the bits the dense forward computes at those
positions (key-block attention, batch-invariant matmuls: docs/engine.md "Prefix
cache"), so a tail attends to exactly what it would have computed.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable

import numpy as np

from megascore.api import layout, schema
from megascore.api.finish import finish_values
from megascore.api.types import ScoreBatch, ScoreOutput
from megascore.engine.cache.index import BlockOutputs, PrefixIndex, chain_keys


@dataclasses.dataclass
class _Sequence:
    """One sequence's plan.

    Attributes:
        keys: chain keys of its full blocks.
        hit: blocks read from the cache.
        slots: slot of every block (``ceil(length / block)``; -1: not written).
        new: slots handed out for it that hold no block yet.
        signature: what its stored outputs are keyed by (per block).
    """

    keys: list[bytes]
    hit: int
    slots: list[int]
    new: list[int]
    signature: list[bytes]


def head_token_outputs(batch: ScoreBatch) -> list[schema.Output]:
    """The per-token outputs the head computes for ``batch``."""
    return [o for o in schema.head_outputs(batch) if o.per == schema.TOKEN]


def _signature(batch: ScoreBatch, b: int, start: int, block: int, count: int) -> list[bytes]:
    """Per block of sequence ``b``, what its stored outputs depend on besides its tokens:
    the temperature, top-k, the outputs computed, the positions mode and, read at the
    block's entries but its last (:func:`_last_key`), the head inputs and (masked
    positions) the loss mask."""
    common = repr(
        (
            float(batch.temperatures()[b]),
            batch.top_k,
            tuple(o.name for o in head_token_outputs(batch)),
            batch.logprob_positions,
        )
    ).encode()
    inputs, out = _entry_inputs(batch), []
    for j in range(count):
        digest = hashlib.blake2b(common, digest_size=16)
        for values in inputs:
            entries = values[start + j * block + 1 : start + (j + 1) * block]
            digest.update(np.ascontiguousarray(entries).tobytes())
        out.append(digest.digest())
    return out


def _entry_inputs(batch: ScoreBatch) -> list[np.ndarray]:
    """What an entry's outputs read besides the tokens: the head inputs at it and, for
    masked positions, the loss mask."""
    inputs = [np.asarray(v) for v in schema.head_inputs(batch).values()]
    if batch.logprob_positions == schema.MASKED and batch.loss_mask is not None:
        inputs.append(np.asarray(batch.loss_mask))
    return inputs


def _last_key(batch: ScoreBatch, ids: np.ndarray, entry: int) -> bytes:
    """What a block's last entry (flat index ``entry``) is stored under: its token and
    :func:`_entry_inputs` at it."""
    parts = [np.asarray(ids[entry]), *(v[entry] for v in _entry_inputs(batch))]
    return b"".join(np.ascontiguousarray(p).tobytes() for p in parts)


class PrefixCache:
    """Rank 0: the index (:class:`~megascore.engine.cache.index.PrefixIndex`) and the plan
    of every step (module docstring).

    Args:
        index: the index.
        block: positions per block (the key-block attention's block).
        keep: keep blocks between calls; False (``--no-prefix-cache``): a call's blocks
            serve its own shared prefixes only and are forgotten after it.
        min_shared: shortest new shared prefix computed once (None: no within-step
            sharing).
        seeds: per sequence of a batch, what names the weights its keys and values are
            computed with (:func:`~megascore.engine.cache.index.chain_keys`' seed: the
            weight set and adapter with their versions); None: one set of weights.
    """

    def __init__(
        self,
        index: PrefixIndex,
        block: int,
        keep: bool,
        min_shared: int | None,
        seeds: Callable[[ScoreBatch], list[bytes]] | None = None,
    ):
        self.index = index
        self.block = block
        self.keep = keep
        self.min_shared = min_shared
        self._seeds = seeds
        self.hit_tokens = 0
        self.lookup_tokens = 0

    def seeds(self, batch: ScoreBatch) -> list[bytes]:
        """Each sequence's key seed (``seeds``)."""
        if self._seeds is None:
            return [b""] * batch.num_sequences
        return self._seeds(batch)

    @staticmethod
    def applies(batch: ScoreBatch) -> bool:
        """Whether a batch may read and write the cache: not when it asks for MoE / MTP
        metrics (formed over every token of the forward) or records or replays routes."""
        return not (
            batch.return_moe_metrics
            or batch.return_mtp_metrics
            or batch.return_routing
            or batch.routing is not None
        )

    def cached_now(self, batch: ScoreBatch, seeds: list[bytes] | None = None) -> np.ndarray:
        """int64 ``[B]`` the cached tokens each sequence would read now, before its outputs
        are checked (an estimate for the server's batcher; read-only, any thread; ``seeds``:
        the sequences' key seeds where ``batch`` is not scored under the live weights)."""
        lengths = np.asarray(batch.lengths, np.int64)
        bounds = layout.offsets(lengths)
        ids = np.asarray(batch.token_ids, np.int64)
        hits = [
            self._cached(chain_keys(ids[a:b], self.block, (b - a) // self.block, seed), b - a)
            for a, b, seed in zip(bounds[:-1], bounds[1:], seeds or self.seeds(batch), strict=True)
        ]
        return np.asarray(hits, np.int64) * self.block

    def forget(self) -> None:
        """Empties the index (the weights changed)."""
        self.index.clear()

    def stats(self) -> dict[str, int]:
        """Counters for the metrics endpoint."""
        return {
            "hit_tokens": self.hit_tokens,
            "lookup_tokens": self.lookup_tokens,
            "stored_bytes": self.index.stored_bytes,
            "blocks": len(self.index.blocks),
            "evictions": self.index.evictions,
            "host_bytes": self.index.host_bytes,
            "demotions": self.index.demotions,
            "promotions": self.index.promotions,
        }

    def score(self, batch: ScoreBatch, run: Callable[[ScoreBatch], ScoreOutput]) -> ScoreOutput:
        """Scores ``batch`` through ``run`` (one step on every rank) with the cache."""
        try:
            if self.min_shared is not None:
                self._share(batch, run)
            return self._score(batch, run, count=True)
        finally:
            if not self.keep:
                self.index.clear()

    # ---- the steps ---------------------------------------------------------------------------

    def _share(self, batch: ScoreBatch, run) -> None:
        """Step 1 of the module docstring: the batch's new shared prefixes, computed once."""
        shared = self._shared_prefixes(batch)
        if shared is None:
            return
        self._share(shared, run)
        self._score(shared, run, count=False)

    def _shared_prefixes(self, batch: ScoreBatch) -> ScoreBatch | None:
        """A batch of the prefixes the batch's sequences share and the cache lacks: each
        ``a + 1`` tokens of one of them, ``a`` a multiple of the block (``a`` tokens are
        cached; the last one is the token the prefix's last row predicts)."""
        lengths = np.asarray(batch.lengths, np.int64)
        bounds = layout.offsets(lengths)
        ids = np.asarray(batch.token_ids, np.int64)
        seqs = [ids[bounds[b] : bounds[b + 1]] for b in range(len(lengths))]
        temps, seeds = batch.temperatures(), self.seeds(batch)
        order = sorted(
            range(len(seqs)), key=lambda b: (seeds[b], float(temps[b]), seqs[b].tobytes())
        )
        picked: dict[bytes, tuple[int, int]] = {}  # key of the prefix -> (sequence, a)
        for x, y in zip(order[:-1], order[1:], strict=True):
            if temps[x] != temps[y] or seeds[x] != seeds[y]:
                continue
            n = min(len(seqs[x]), len(seqs[y]))
            differ = np.flatnonzero(seqs[x][:n] != seqs[y][:n])
            lcp = int(differ[0]) if differ.size else n
            a = (lcp - 1) // self.block * self.block
            if a < self.block:
                continue
            keys = chain_keys(seqs[x], self.block, a // self.block, seeds[x])
            signature = _signature(batch, x, int(bounds[x]), self.block, len(keys))
            usable = self._usable(batch, x, int(bounds[x]), keys, signature, a + 1)
            new = a - usable * self.block
            if new >= max(self.min_shared, 1) and keys[-1] not in picked:
                picked[keys[-1]] = (x, a)
        if not picked:
            return None
        members = sorted(picked.values())
        return _prefix_batch(batch, members)

    def _score(self, batch: ScoreBatch, run, *, count: bool) -> ScoreOutput:
        """Steps 2-3 of the module docstring for one batch."""
        plans = self._plan(batch)
        hits = np.asarray([p.hit * self.block for p in plans], np.int64)
        moves = self.index.take_moves()
        try:
            tail_output = run(_tail_batch(batch, plans, hits, self.block, moves))
        except BaseException:
            if moves:  # the ranks may have made some of them: no slot's content is known
                self.index.clear()
            else:
                for p in plans:
                    for slot in p.new:
                        self.index.release(slot)
            raise
        values = self._join(batch, plans, hits, tail_output)
        self._commit(batch, plans, values)
        if count:
            self.hit_tokens += int(hits.sum())
            self.lookup_tokens += batch.num_tokens
        tail_output.values = finish_values(dataclasses.replace(batch, cache_hits=hits), values)
        return tail_output

    def _plan(self, batch: ScoreBatch) -> list[_Sequence]:
        """Step 2 of the module docstring."""
        block = self.block
        lengths = np.asarray(batch.lengths, np.int64)
        bounds = layout.offsets(lengths)
        ids = np.asarray(batch.token_ids, np.int64)
        plans, pinned, taken, seeds = [], set(), {}, self.seeds(batch)
        for b, length in enumerate(lengths):
            start, length = int(bounds[b]), int(length)
            keys = chain_keys(ids[start : start + length], block, length // block, seeds[b])
            signature = _signature(batch, b, start, block, len(keys))
            hit = self._usable(batch, b, start, keys, signature, length)
            pinned.update(keys[:hit])
            hit = self.index.promote(keys[:hit], pinned)  # from the host tier
            plans.append(_Sequence(keys, hit, [], [], signature))
        for b, p in enumerate(plans):  # slots: read below the hit, written from it
            p.slots = [self.index.blocks[k].slot for k in p.keys[: p.hit]]
            for key in p.keys[p.hit :]:
                if key in self.index.blocks:  # rewritten with the same bits, or left
                    slot = self.index.blocks[key].slot  # in the host tier (not read here)
                    slot = slot if slot < self.index.num_slots else -1
                elif key in taken:
                    slot = taken[key]
                else:
                    slot = self.index.allocate(pinned)
                    slot = -1 if slot is None else slot
                    if slot >= 0:
                        taken[key] = slot
                        p.new.append(slot)
                p.slots.append(slot)
                if slot >= 0:
                    pinned.add(key)
            p.slots += [-1] * (-(-int(lengths[b]) // block) - len(p.slots))
        return plans

    def _cached(self, keys: list[bytes], length: int) -> int:
        """Cached blocks a sequence of ``length`` tokens with chain ``keys`` finds: its run
        of cached keys, less its last row's block (always computed)."""
        return min(self.index.hits(keys), (length - 1) // self.block)

    def _usable(self, batch, b: int, start: int, keys, signature, length: int) -> int:
        """Cached blocks sequence ``b`` (its first ``length`` tokens) can read
        (:meth:`_cached`), cut to the blocks whose outputs it has where it asks for them
        (``signature``: :func:`_signature` of its blocks)."""
        score_from = 0 if batch.score_from is None else int(batch.score_from[b])
        first_needed = max(1, score_from) if head_token_outputs(batch) else length
        hit = self._cached(keys, length)
        if hit and first_needed <= hit * self.block:
            hit = self._first_missing(batch, keys, signature, hit, first_needed, start)
        return hit

    def _first_missing(self, batch, keys, signature, hit, first_needed, start) -> int:
        """The first of the ``hit`` blocks that lacks an entry the sequence asks for."""
        ids = batch.token_ids
        for j in range(hit):
            end = (j + 1) * self.block
            if end < first_needed:
                continue  # its entries are all before score_from
            stored = self.index.blocks[keys[j]].outputs.get(signature[j])
            if stored is None or _last_key(batch, ids, start + end) not in stored.last:
                return j
        return hit

    def _join(self, batch, plans, hits, tail_output) -> dict:
        """Step 3: the per-token head outputs of the whole sequences (stored entries of
        the cached blocks, then the tail's), with the per-sequence head outputs."""
        block = self.block
        lengths = np.asarray(batch.lengths, np.int64)
        ids = np.asarray(batch.token_ids, np.int64)
        full_bounds = layout.offsets(lengths)
        tail_bounds = layout.offsets(lengths - hits)
        values = {}
        for out in head_token_outputs(batch):
            tail = tail_output.values[out.name]
            full = np.full((batch.num_tokens, *tail.shape[1:]), out.fill, dtype=tail.dtype)
            for b, p in enumerate(plans):
                a, h = int(full_bounds[b]), int(hits[b])
                full[a + h + 1 : int(full_bounds[b + 1])] = tail[
                    int(tail_bounds[b]) + 1 : int(tail_bounds[b + 1])
                ]
                for j in range(p.hit):
                    stored = self.index.blocks[p.keys[j]].outputs.get(p.signature[j])
                    end = a + (j + 1) * block
                    last = None if stored is None else stored.last.get(_last_key(batch, ids, end))
                    if last is not None:  # else its entries are all before score_from
                        full[a + j * block + 1 : end] = stored.values[out.name]
                        full[end] = last[out.name]
            values[out.name] = full
        for out in schema.head_outputs(batch):
            if schema.at_last_row(out):
                values[out.name] = tail_output.values[out.name]
        return values

    def _commit(self, batch, plans, values) -> None:
        """The step succeeded: its new blocks enter the index with their outputs; the
        blocks it read become the most recently used."""
        block = self.block
        lengths = np.asarray(batch.lengths, np.int64)
        bounds = layout.offsets(lengths)
        ids = np.asarray(batch.token_ids, np.int64)
        score_from = (
            np.zeros(len(lengths), np.int64) if batch.score_from is None else batch.score_from
        )
        outputs = head_token_outputs(batch)
        pinned = {k for p in plans for k in p.keys}
        for b, p in enumerate(plans):
            start, length = int(bounds[b]), int(lengths[b])
            self.index.touch(p.keys[: p.hit])
            for j in range(p.hit, len(p.keys)):
                key, slot = p.keys[j], p.slots[j]
                if slot < 0:
                    continue
                if key not in self.index.blocks:
                    self.index.insert(key, p.keys[j - 1] if j else None, slot)
                end = (j + 1) * block
                computed = j * block + 1 >= max(1, int(score_from[b]))
                if outputs and computed and end < length:  # the next token is known
                    entries = slice(start + j * block + 1, start + end)
                    stored = BlockOutputs(
                        {o.name: np.array(values[o.name][entries]) for o in outputs},
                        {
                            _last_key(batch, ids, start + end): {
                                o.name: np.array(values[o.name][start + end]) for o in outputs
                            }
                        },
                    )
                    self.index.add_outputs(key, p.signature[j], stored, pinned)


def _tail_batch(batch: ScoreBatch, plans: list[_Sequence], hits: np.ndarray, block: int, moves):
    """The batch the ranks compute: every sequence from its first uncached token on, with
    the cache plan (``cache_hits``, ``cache_slots`` and the tiers' ``cache_moves``)."""
    every = np.arange(batch.num_sequences)
    tails = _cut(batch, every, hits, np.asarray(batch.lengths, np.int64) - hits)
    slots = np.asarray([s for p in plans for s in p.slots], np.int64)
    if batch.score_from is not None:
        tails = dataclasses.replace(
            tails, score_from=np.maximum(np.asarray(batch.score_from) - hits, 0)
        )
    moves = np.asarray(moves, np.int64).reshape(-1, 2)
    return dataclasses.replace(tails, cache_hits=hits, cache_slots=slots, cache_moves=moves)


def _prefix_batch(batch: ScoreBatch, members: list[tuple[int, int]]) -> ScoreBatch:
    """A batch of ``a + 1`` tokens of each ``(sequence, a)``, with that sequence's inputs
    and options (its outputs are stored with the prefix's blocks)."""
    seqs = np.asarray([b for b, _ in members], np.int64)
    first = np.zeros(len(members), np.int64)
    return _cut(batch, seqs, first, np.asarray([a + 1 for _, a in members], np.int64))


def _cut(batch: ScoreBatch, seqs: np.ndarray, first: np.ndarray, count: np.ndarray):
    """Sequences ``seqs`` of ``batch``, each its ``count`` tokens from ``first`` on, with
    their per-token inputs cut alike and their per-sequence inputs and options."""
    keep = layout.ranges(layout.offsets(np.asarray(batch.lengths, np.int64))[seqs] + first, count)
    fields = {"token_ids": np.asarray(batch.token_ids)[keep], "lengths": count}
    for spec in schema.INPUTS:
        values = getattr(batch, spec.name)
        if values is not None:
            fields[spec.name] = np.asarray(values)[keep if spec.per == schema.TOKEN else seqs]
    return dataclasses.replace(batch, cache_hits=None, cache_slots=None, cache_moves=None, **fields)

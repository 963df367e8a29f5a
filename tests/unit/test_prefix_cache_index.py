"""The prefix cache's index (``megascore.engine.cache.index``): slots, the byte budget and
the segmented LRU; and an engine whose budget sees ten times its size in new prefixes."""

from __future__ import annotations

import numpy as np
import pytest

from megascore.api.types import ScoreBatch
from megascore.config import EngineConfig
from megascore.engine.cache.index import BlockOutputs, PrefixIndex, chain_keys
from megascore.engine.runtime import DistributedEngine
from tests.one_rank import one_rank_world


def _chain(index: PrefixIndex, seed: int, blocks: int, pinned=frozenset()) -> list[bytes]:
    """Inserts a new chain of ``blocks`` blocks (as a step's commit does); its keys."""
    keys = chain_keys(np.random.default_rng(seed).integers(0, 1000, 4 * blocks), 4, blocks)
    for j, key in enumerate(keys):
        slot = index.allocate(set(pinned) | set(keys[:j]))
        assert slot is not None
        index.insert(key, keys[j - 1] if j else None, slot)
    return keys


def test_chain_keys_name_the_whole_prefix():
    a = chain_keys(np.arange(12), 4, 3)
    b = chain_keys(np.r_[np.arange(8), 9, 9, 9, 9], 4, 3)
    c = chain_keys(np.r_[99, np.arange(1, 12)], 4, 3)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert not set(a) & set(c)  # one token apart in block 0: every key differs


def test_slots_stay_within_the_budget_and_are_reused():
    index = PrefixIndex(num_slots=10, slot_bytes=100, budget_bytes=1000)
    for seed in range(30):
        _chain(index, seed, 3)
        assert len(index.blocks) <= 10 and index.stored_bytes <= 1000
    slots = [block.slot for block in index.blocks.values()]
    assert len(set(slots)) == len(slots) and set(slots) <= set(range(10))
    assert index.evictions == 30 * 3 - len(index.blocks)


def test_outputs_count_in_the_budget():
    index = PrefixIndex(num_slots=10, slot_bytes=100, budget_bytes=1000)
    keys = _chain(index, 0, 2)
    big = BlockOutputs({"logprobs": np.zeros(100, np.float32)}, {b"t": {}})  # 400 bytes
    index.add_outputs(keys[1], b"sig", big, pinned=set(keys))
    assert index.stored_bytes == 2 * 100 + 400
    _chain(index, 1, 5)  # 7 blocks and the outputs: 1100 bytes, one block must go
    assert index.stored_bytes <= 1000


def test_a_hit_prefix_survives_a_flood_of_new_ones():
    index = PrefixIndex(num_slots=20, slot_bytes=1, budget_bytes=20)
    hot = _chain(index, 0, 4)
    index.touch(hot)  # read once: protected
    for seed in range(1, 200):  # ten times the slots in new, never repeated prefixes
        _chain(index, seed, 1)
    assert index.hits(hot) == 4
    cold = _chain(index, 500, 4)
    for seed in range(600, 640):
        _chain(index, seed, 1)
    assert index.hits(cold) == 0  # never read: cycled out through probation


def test_the_protected_segment_has_a_cap():
    index = PrefixIndex(num_slots=8, slot_bytes=1, budget_bytes=8)
    chains = [_chain(index, seed, 2) for seed in range(4)]
    for keys in chains:
        index.touch(keys)  # 8 blocks read, at most 4 protected
    assert len(index._protected) == 4
    _chain(index, 99, 2)  # the two chains read first fell back to probation: one goes
    assert [index.hits(keys) for keys in chains] == [0, 2, 2, 2]


def test_pinned_blocks_and_what_continues_them_are_never_evicted():
    index = PrefixIndex(num_slots=4, slot_bytes=1, budget_bytes=4)
    keys = _chain(index, 0, 4)
    assert index.allocate({keys[-1]}) is None  # evicting block 0 would evict the pinned one
    assert index.hits(keys) == 4
    assert index.allocate({keys[1]}) is not None  # blocks 2 and 3 only continue it
    assert index.hits(keys) == 2


def test_evicting_a_block_evicts_what_continues_it_and_frees_their_slots():
    index = PrefixIndex(num_slots=4, slot_bytes=1, budget_bytes=4)
    keys = _chain(index, 0, 3)
    index.touch(keys[:1])  # block 0 read: protected; blocks 1 and 2 in probation
    _chain(index, 1, 3)  # one slot is free; evicting block 1 frees block 2's too
    assert index.hits(keys) == 1 and index.evictions == 2
    assert len(index.blocks) + len(index._free) == 4


def test_clear_forgets_everything():
    index = PrefixIndex(num_slots=6, slot_bytes=1, budget_bytes=6)
    keys = _chain(index, 0, 3)
    index.clear()
    assert index.hits(keys) == 0 and index.stored_bytes == 0 and len(index._free) == 6


@pytest.mark.parametrize("block", [16])
def test_an_engine_under_ten_times_its_budget_keeps_its_hot_prefix(block):
    """Distinct prefixes worth ten budgets go through; every request is answered, the
    stored bytes stay within the budget and the prefix read between them keeps hitting."""
    rng = np.random.default_rng(0)
    hot = rng.integers(1, 500, 6 * block)
    with one_rank_world():
        engine = DistributedEngine.create(
            EngineConfig(model="tiny", attention_block=block, prefix_cache_gib=0.0005)
        )
        try:
            budget = engine._cache.index.budget_bytes
            slot = engine._cache.index.slot_bytes
            hits, flood = [], 0
            while flood < 10 * budget:
                seqs = [rng.integers(1, 500, 6 * block) for _ in range(4)]
                out = engine.score(ScoreBatch(np.concatenate(seqs), np.full(4, 6 * block)))
                assert len(out.logprobs) == 4 * 6 * block
                flood += 4 * 5 * slot  # five full blocks each, the last one's row aside
                turn = np.r_[hot, rng.integers(1, 500, 10)]
                hits.append(
                    int(engine.score(ScoreBatch(turn, np.array([len(turn)]))).cached_tokens[0])
                )
                assert engine._cache.index.stored_bytes <= budget
        finally:
            engine.shutdown()
    assert engine._cache.index.evictions > 0
    # the hot prefix's 6 blocks are cached; the last one's last entry predicts the turn's
    # own first token, new every time: 5 blocks are read
    assert hits[0] == 0 and all(h == 5 * block for h in hits[1:]), hits


def test_the_host_tier_takes_what_the_device_evicts_and_gives_it_back():
    index = PrefixIndex(num_slots=4, slot_bytes=1, budget_bytes=4, host_slots=6)
    first = _chain(index, 0, 3)
    device_slots = [index.blocks[k].slot for k in first]
    _chain(index, 1, 3)  # 6 blocks, 4 device slots: two of the first chain move
    moves = index.take_moves()
    assert len(moves) == 2 and index.demotions == 2 and index.evictions == 0
    assert all(src < 4 <= dst < 10 for src, dst in moves)
    assert [src for src, _ in moves] == device_slots[:2]  # least recently used first
    assert index.hits(first) == 3  # still cached, in either tier
    assert index.stored_bytes == 4 and index.host_bytes == 2
    assert index.take_moves() == []  # taken once
    pinned = set(first)
    assert index.promote(first, pinned) == 3
    back = index.take_moves()
    # two device blocks of the second chain make room (to the host), then the first
    # chain's two blocks come back, each move after the one that freed its target
    assert [b for b in back if b[0] >= 4] and all(index.blocks[k].slot < 4 for k in first), back
    for n, (src, _) in enumerate(back):
        if src >= 4:  # a promotion reads a host slot no earlier move wrote
            assert all(d != src for _, d in back[:n])
    assert index.promotions == 2


def test_a_full_host_tier_drops_its_least_recently_used_with_what_continues_it():
    index = PrefixIndex(num_slots=2, slot_bytes=1, budget_bytes=2, host_slots=2)
    first = _chain(index, 0, 2)
    second = _chain(index, 1, 2)  # the first chain moves to the host
    assert index.hits(first) == 2 and index.host_bytes == 2
    _chain(index, 2, 2)  # the second moves there; the first is dropped
    assert index.hits(first) == 0 and index.hits(second) == 2
    assert index.evictions == 2 and index.host_bytes == 2
    slots = [b.slot for b in index.blocks.values()]
    assert sorted(slots) == [0, 1, 2, 3]


def test_a_pinned_block_never_moves():
    index = PrefixIndex(num_slots=2, slot_bytes=1, budget_bytes=2, host_slots=4)
    keys = _chain(index, 0, 2)
    assert index.allocate(set(keys)) is None  # both device blocks are read by the step
    assert index.take_moves() == []

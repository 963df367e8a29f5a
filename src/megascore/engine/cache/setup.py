"""Whether a replica runs the prefix cache, and its size (every rank, at start-up and after a
reload).

The cache needs the key-block attention (:mod:`megascore.model.attention`: a block's keys
and values are the same bits however its sequence is split), so the two go together:
:func:`key_block` is the block both use, or 0 for neither. :func:`configure` marks every
attention layer of a built model with it and with its layer index in the store;
:func:`slot_bytes` is what one block takes on this rank.
"""

from __future__ import annotations

import logging
import math
import os

import torch
import torch.distributed as dist

from megascore.config import EngineConfig
from megascore.engine.cache.index import PrefixIndex
from megascore.engine.cache.store import PrefixStore
from megascore.model.attention import TorchCoreAttention

logger = logging.getLogger(__name__)

MAX_AUTO_GIB = 4.0


def key_block(engine_cfg: EngineConfig, device: torch.device, layout: dict[str, int]) -> int:
    """The block of the key-block attention and the cache, or 0 (off).

    On by default where the step is batch-invariant (the CPU); ``prefix_cache`` True turns
    it on elsewhere, False keeps the mechanism for a call's own shared prefixes; a budget
    of 0 turns it off. Off, with the reason logged, under context parallelism (a rank's
    keys are not its sequences' whole), with the TransformerEngine attention, or when the
    block is not a multiple of the pad multiple. Data-parallel ranks (and so expert
    parallelism) keep it: every rank of a DP group holds every cached block
    (:meth:`megascore.engine.cache.store.PrefixStore.share_written`).

    Args:
        engine_cfg: the engine config.
        device: the model's device.
        layout: the ``cp`` size, the step's ``pad_multiple`` and the built model's
            attention ``backend``.
    """
    wanted = engine_cfg.prefix_cache or engine_cfg.batch_invariant_on(device.type)
    if not wanted or engine_cfg.prefix_cache_gib == 0:
        return 0
    reason = None
    if layout["cp"] > 1:
        reason = "context parallelism"
    elif layout["backend"] != "torch":
        reason = "the TransformerEngine attention backend"
    elif engine_cfg.attention_block % layout["pad_multiple"]:
        reason = f"attention_block not a multiple of the pad multiple {layout['pad_multiple']}"
    if reason is not None:
        (logger.warning if engine_cfg.prefix_cache else logger.info)("prefix cache off: %s", reason)
        return 0
    return engine_cfg.attention_block


def configure(model: torch.nn.Module, block: int) -> list[TorchCoreAttention]:
    """Sets every attention layer's key block and cache index; returns the layers."""
    layers = [m for m in model.modules() if isinstance(m, TorchCoreAttention)]
    for index, module in enumerate(layers):
        module.key_block = block
        module.cache_index = index
    return layers


def _rows(module: TorchCoreAttention, tp_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The shape of one row of a layer's keys and of its values on this rank: its query
    groups, or its heads for multi-latent attention, whose values are padded to the key
    dim in the packed layout."""
    config = module.config
    if config.multi_latent_attention:
        row = (config.num_attention_heads // tp_size, module.head_dim)
    else:
        groups = config.num_query_groups or config.num_attention_heads
        row = (groups // tp_size, config.kv_channels)
    return row, row


def slot_bytes(model: torch.nn.Module, block: int, tp_size: int) -> int:
    """Bytes of one block's keys and values on this rank (every attention layer of it)."""
    total = 0
    for module in configure(model, block):
        size = torch.tensor([], dtype=module.config.params_dtype).element_size()
        total += block * size * sum(math.prod(row) for row in _rows(module, tp_size))
    return total


def budget_bytes(engine_cfg: EngineConfig) -> int:
    """The cache's byte budget: ``prefix_cache_gib``, or 1/8 of the machine's memory (at
    most :data:`MAX_AUTO_GIB`)."""
    if engine_cfg.prefix_cache_gib is not None:
        return int(engine_cfg.prefix_cache_gib * 2**30)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(memory / 8, MAX_AUTO_GIB * 2**30))


def largest_slot(local: int, group: dist.ProcessGroup) -> int:
    """The largest of every rank's :func:`slot_bytes` (a collective over ``group``)."""
    value = torch.tensor([local], dtype=torch.int64)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return int(value)


def start(
    engine_cfg: EngineConfig, model, device: torch.device, layout: dict, group
) -> tuple[PrefixStore, PrefixIndex] | None:
    """Every rank: the replica's store and index (the index is rank 0's to use), or None
    when it runs no cache (:func:`key_block`). A collective over ``group`` (every rank of
    the replica: the largest bytes per block decides the slots).

    Args:
        engine_cfg: the engine config.
        model: this rank's built model (its attention layers are configured).
        device: the model's device.
        layout: what :func:`key_block` reads, and ``tp``.
        group: the replica's status group.
    """
    block = key_block(engine_cfg, device, layout)
    if not block:
        return None
    slot = max(1, largest_slot(slot_bytes(model, block, layout["tp"]), group))
    budget = budget_bytes(engine_cfg)
    num_slots = budget // slot
    host_slots = int(engine_cfg.prefix_cache_host_gib * 2**30) // slot
    logger.info(
        "prefix cache: %d blocks of %d positions (%.2f MiB each on the largest rank, budget "
        "%.2f GiB), %d more in host memory%s",
        num_slots,
        block,
        slot / 2**20,
        budget / 2**30,
        host_slots,
        "" if engine_cfg.prefix_cache is not False else ", kept within a call only",
    )
    layers = configure(model, block)
    rows = [_rows(module, layout["tp"]) for module in layers]
    dtype = layers[0].config.params_dtype if layers else torch.float32
    store = PrefixStore(num_slots, block, rows, dtype, device, host_slots)
    return store, PrefixIndex(num_slots, slot, budget, host_slots=host_slots)

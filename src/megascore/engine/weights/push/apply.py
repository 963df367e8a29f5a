"""Weight pushes on every rank: stage this rank's shards of pushed tensors, swap on commit.

A push (``UpdateWeights``) arrives on rank 0 one full tensor at a time. Rank 0
broadcasts only its name, dtype and shape (``protocol.Command.WEIGHTS_TENSOR``), then
sends each other rank just the parts of it that rank reads (:meth:`WeightStaging.receive`,
point to point): at TP = 2 a rank gets half of a column- or row-parallel tensor and
the whole of a replicated one; an EP rank only its experts' tensors; a pipeline stage
only its layers'. Which parts: each rank lists them at WEIGHTS_BEGIN
(:attr:`WeightStaging.needs`, from a dry run of its recipes that records what they
read; parts and readers in :mod:`megascore.engine.weights.push.parts`) and
:func:`gather_needs` gives rank 0 every rank's list.

Each rank then stages its shards with the recipes the checkpoint loaders use, and
through the same call (``Recipe.read_into``, which ``hf:`` loading runs into the
parameters themselves): the pushed parts are the reader, a staging tensor the output.

* HF names: :mod:`megascore.checkpoint.hf_names` maps every Megatron parameter
  to the HF tensors it is made of (fused QKV per query group, ``[gate; up]`` per
  TP rank, vocab-parallel rows, this EP rank's experts). A pushed tensor's parts are
  kept only until every parameter that reads them has its shard (q, k and v arrive
  one after the other), then dropped.
* Megatron names (the unsharded local-spec model, experts by global index): the
  shard is cut as Megatron shards (:func:`megascore.model.weights.shard_full_tensor`):
  ``stride`` blocks of the partition dimension, this rank's.

Rank 0 checks names, shapes and dtypes before anything is sent, against what every
rank listed at WEIGHTS_BEGIN (:func:`weight_targets`, joined by :func:`gather_targets`:
each pipeline stage and EP rank knows only its own layers and experts).

Nothing touches the served parameters before the commit: the shards wait in
:class:`WeightStaging` (host memory, pinned for CUDA parameters, the parameters'
dtype) while forward steps keep running on the old weights. On WEIGHTS_COMMIT every
rank checks that it can commit (every parameter staged unless the push is partial; no
half-sent fused group; no staging error), the ranks agree (``step.agree_on_status``),
and only then does each put its shards in, between two engine steps: a CPU parameter
takes its staged tensor as is, a GPU one has it copied in and the staging is freed.
(``LoadWeights`` writes the parameters in place instead, after the ranks agree on the
checks: no second copy of the weights, but no serving while it writes; a push keeps
serving, so it stages.)
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megascore.api.errors import CheckpointError
from megascore.api.types import (
    LAYOUT_COMMON,
    LAYOUT_FUSED,
    LAYOUT_PER_EXPERT,
    WEIGHT_NAMES_HF,
    WEIGHT_NAMES_MEGATRON,
    WeightTarget,
)
from megascore.checkpoint.hf_names import ParamMapper
from megascore.checkpoint.recipes import ParallelRanks, Recipe
from megascore.engine.weights.push import transfer
from megascore.engine.weights.push.parts import (
    Parts,
    Recorder,
    all_gather_json,
    block_keys,
    part_index,
)
from megascore.model.config import ModelConfig
from megascore.model.weights import (
    canonical_shards,
    decoder_layer_offset,
    full_shape,
    unwrap_model,
)

logger = logging.getLogger(__name__)


def _parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's state-dict entries a push replaces (TE's ``_extra_state`` excluded)."""
    state = unwrap_model(model).state_dict(keep_vars=True)
    return {name: t for name, t in state.items() if not name.endswith("_extra_state")}


def _hf_recipes(
    model: torch.nn.Module, config: ModelConfig, ranks: ParallelRanks, fused: bool
) -> dict[str, Recipe]:
    """Megatron parameter -> recipe over HF names, for the rank at ``ranks``."""
    mapper = ParamMapper(config, _LayoutNames(fused), ranks)
    offset = decoder_layer_offset(unwrap_model(model))
    recipes = {}
    for name, param in _parameters(model).items():
        recipe = mapper(name, offset)
        recipe.fit(tuple(param.shape))
        if recipe.local_shape() != tuple(param.shape):
            raise CheckpointError(
                f"{name}: this rank's shard of {recipe.sources()} has shape "
                f"{recipe.local_shape()}, the parameter {tuple(param.shape)}"
            )
        recipes[name] = recipe
    return recipes


def _hf_layouts(config: ModelConfig) -> tuple[int, ...]:
    return (LAYOUT_PER_EXPERT, LAYOUT_FUSED) if config.is_moe else (LAYOUT_PER_EXPERT,)


class _LayoutNames:
    """What the HF name mapper asks of a checkpoint before reading it, answered for one
    expert layout: its names (fused expert tensors or not) and whether Mixtral's
    per-expert names are in it."""

    def __init__(self, fused: bool):
        self.fused = fused

    def names(self) -> list[str]:
        return ["model.layers.0.mlp.experts.gate_up_proj"] if self.fused else []

    def __contains__(self, name: str) -> bool:
        return not self.fused and "block_sparse_moe." in name


def _megatron_layout(model: torch.nn.Module, config: ModelConfig, pg_collection) -> dict:
    """This rank's parameters by canonical name (the unsharded single-stage local-spec
    model: global layer and expert indices): ``(local name, partition dim, stride, rank,
    size, full shape)``."""
    params = _parameters(model).items()
    shards = canonical_shards(
        unwrap_model(model), params, pg_collection, config.num_moe_experts, config.gated_linear_unit
    )
    table = {}
    for name, param, canon, (dim, stride, rank, size) in shards:
        table[canon] = (name, dim, stride, rank, size, tuple(full_shape(param.shape, dim, size)))
    return table


def weight_targets(
    model: torch.nn.Module, config: ModelConfig, pg_collection, names: int
) -> dict[str, WeightTarget]:
    """The tensor names a push may carry that this rank's parameters are made of, with
    their full shapes (:func:`gather_targets` joins every rank's).

    Args:
        model: this rank's model.
        config: its architecture.
        pg_collection: its process groups.
        names: ``WEIGHT_NAMES_HF`` or ``WEIGHT_NAMES_MEGATRON``.

    Returns:
        name -> :class:`WeightTarget`. For HF names of an MoE model, both expert
        layouts (per expert, fused) are listed, each name with its layout.
    """
    if names == WEIGHT_NAMES_MEGATRON:
        return {
            c: WeightTarget(e[5]) for c, e in _megatron_layout(model, config, pg_collection).items()
        }
    if names != WEIGHT_NAMES_HF:
        raise ValueError(f"unknown weight name format {names}")
    ranks = ParallelRanks.from_model(unwrap_model(model))
    found: dict[str, tuple[tuple[int, ...], set[int]]] = {}
    for layout in _hf_layouts(config):
        for recipe in _hf_recipes(model, config, ranks, layout == LAYOUT_FUSED).values():
            for src in recipe.srcs:
                found.setdefault(src.name, (tuple(src.full or src.shape), set()))[1].add(layout)
    every = set(_hf_layouts(config))
    return {
        name: WeightTarget(shape, LAYOUT_COMMON if layouts == every else layouts.pop())
        for name, (shape, layouts) in found.items()
    }


def gather_targets(
    local: dict[str, WeightTarget] | None, group, config: ModelConfig, names: int
) -> dict[str, WeightTarget]:
    """Every rank's :func:`weight_targets` joined (collective over ``group``; every rank
    gets the union).

    Args:
        local: this rank's targets, or None when it could not list them.
        group: every rank of the replica (gloo).
        config: the served architecture (a tied ``lm_head.weight`` is accepted, ignored).
        names: the push's name format.

    Raises:
        CheckpointError: on every rank, when some rank could not list its targets.
    """
    own = None if local is None else [[n, t.shape, t.layout, t.ignored] for n, t in local.items()]
    union: dict[str, WeightTarget] = {}
    failed = []
    for rank, rows in enumerate(all_gather_json(own, group)):
        if rows is None:
            failed.append(rank)
            continue
        for name, shape, layout, ignored in rows:
            union[name] = WeightTarget(tuple(shape), layout, ignored)
    if failed:
        raise CheckpointError(f"ranks {failed} could not list the tensors of a weight push")
    tied = config.share_embeddings_and_output_weights
    if names == WEIGHT_NAMES_HF and tied and "lm_head.weight" not in union:
        embed = union["model.embed_tokens.weight"]
        union["lm_head.weight"] = WeightTarget(embed.shape, ignored=True)
    return union


def gather_needs(staging: WeightStaging, group) -> None:
    """Gives every rank's :attr:`WeightStaging.needs` to the others (collective over
    ``group``, after :func:`gather_targets` succeeded on every rank): rank 0 sends
    each rank its parts from them (:attr:`WeightStaging.peers`)."""
    ranks = dist.get_process_group_ranks(group)
    own = {str(layout): list(table.items()) for layout, table in staging.needs.items()}
    staging.peers = {
        rank: {
            int(layout): {name: [_json_key(k) for k in keys] for name, keys in table}
            for layout, table in needs.items()
        }
        for rank, needs in zip(ranks, all_gather_json(own, group), strict=True)
        if rank != dist.get_rank()
    }


def _json_key(key: list) -> tuple:
    return tuple(i if isinstance(i, int) else tuple(i) for i in key)


class WeightStaging:
    """One rank's side of an open push: the parts it reads, the staged shards, the swap.

    Args:
        model: this rank's model (its parameters are replaced on :meth:`apply`).
        config: its architecture.
        pg_collection: its process groups.
        names: ``WEIGHT_NAMES_HF`` or ``WEIGHT_NAMES_MEGATRON``.
        buffers: host tensors of the parameters' shapes and dtypes to stage into (what
            the previous push's :meth:`apply` or :meth:`release` returned): memory
            written before, so staging does not pay the page faults of new memory.

    Attributes:
        needs: expert layout -> pushed tensor name -> the parts of it this rank reads
            (:func:`~megascore.engine.weights.push.parts.part_key`; ``()`` the whole
            tensor). Names this rank does not read are absent. Megatron names: one
            table, under ``LAYOUT_COMMON``.
        peers: on the sending rank, every other rank's ``needs`` by global rank
            (:func:`gather_needs`).
        sent_bytes, received_bytes: bytes of tensor parts sent to other ranks (rank 0)
            and received from rank 0 (others) in this push.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        pg_collection,
        names: int,
        buffers: dict[str, torch.Tensor] | None = None,
    ):
        self.model, self.config = model, config
        self.params = _parameters(model)
        self.buffers = dict(buffers or {})  # host tensors to stage into, by parameter
        self.staged: dict[str, torch.Tensor] = {}
        self.pending = Parts()  # pushed parts some shard still waits for
        self.error: str | None = None
        self.peers: dict[int, dict[int, dict[str, list[tuple]]]] = {}
        self.sent_bytes = self.received_bytes = 0
        self._recipes: dict[int, dict[str, Recipe]] = {}
        self._consumers: dict[int, dict[str, list[str]]] = {}
        self._megatron = None
        self._layout = LAYOUT_COMMON  # the HF expert layout, once a tensor told it
        if names == WEIGHT_NAMES_MEGATRON:
            self._megatron = _megatron_layout(model, config, pg_collection)
            self.needs = {
                LAYOUT_COMMON: {
                    canon: block_keys(dim, stride, rank, size, shape)
                    for canon, (_, dim, stride, rank, size, shape) in self._megatron.items()
                }
            }
        elif names == WEIGHT_NAMES_HF:
            self.needs = {layout: self._record(layout) for layout in _hf_layouts(config)}
        else:
            raise ValueError(f"unknown weight name format {names}")

    def _record(self, layout: int) -> dict[str, list[tuple]]:
        """The parts of each HF tensor this rank's recipes of ``layout`` read (a dry run
        on ``meta`` tensors); a recipe that cannot run dry reads its sources whole."""
        recipes, _ = self._plan(layout)
        shapes = {src.name: src.full or src.shape for r in recipes.values() for src in r.srcs}
        recorder = Recorder(shapes)
        for param, recipe in recipes.items():
            out = torch.empty(self.params[param].shape, device="meta")
            try:
                recipe.read_into(recorder, out)
            except Exception:  # noqa: BLE001 - e.g. a recipe that builds a host tensor
                logger.debug("dry run of %s failed: its sources are sent whole", param)
                for src in recipe.sources():
                    recorder.reads[src] = {(): None}
        return {name: list(keys) for name, keys in recorder.reads.items()}

    def receive(self, name: str, tensor: torch.Tensor, layout: int, group, src: int) -> None:
        """Every rank, in step, after a WEIGHTS_TENSOR header: rank ``src`` (holding the
        full ``tensor``) sends each rank the parts of it that rank reads
        (:attr:`peers`), every other rank (holding a ``meta`` tensor of its shape)
        receives its own (:attr:`needs`); then each stages its shards (:meth:`add`).

        Raises:
            RuntimeError: the transfer failed (the replica is then out of step).
        """
        table = LAYOUT_COMMON if self._megatron is not None else _needs_table(layout)
        if dist.get_rank() == src:
            parts = {
                rank: [tensor[part_index(k)] for k in needs.get(table, {}).get(name, ())]
                for rank, needs in self.peers.items()
            }
            self.sent_bytes += transfer.send_parts(parts, group)
            self.add(name, tensor, layout)
            return
        keys = self.needs[table].get(name, [])
        if not keys:
            return
        shapes = [tensor[part_index(k)].shape for k in keys]
        pieces = transfer.recv_parts(shapes, tensor.dtype, src, group)
        self.received_bytes += sum(p.numel() * p.element_size() for p in pieces)
        self._stage(name, dict(zip(keys, pieces, strict=True)), layout)

    def add(self, name: str, tensor: torch.Tensor, layout: int) -> None:
        """Stages this rank's shards of the full tensor ``name`` (if it needs any)."""
        self._stage(name, {(): tensor}, layout)

    def _stage(self, name: str, parts: dict[tuple, torch.Tensor], layout: int) -> None:
        """Stages this rank's shards that ``parts`` of tensor ``name`` complete.

        A failure is recorded (reported by :meth:`problem` at commit time, when the
        ranks agree), never raised: the ranks must stay in step.
        """
        if self.error is not None:
            return
        try:
            if self._megatron is not None:
                self._stage_megatron(name, parts)
            else:
                self._stage_hf(name, parts, layout)
        except Exception as e:  # noqa: BLE001 - reported to every rank at the commit
            logger.exception("staging %r failed", name)
            self.error = f"staging {name!r} failed: {type(e).__name__}: {e}"

    def _stage_megatron(self, name: str, parts: dict[tuple, torch.Tensor]) -> None:
        entry = self._megatron.get(name)
        if entry is None:
            return  # another rank's (stage, expert)
        local, dim = entry[0], entry[1]
        reader = Parts()
        reader.tensors[name] = parts
        blocks = [reader.read(name, part_index(k)) for k in self.needs[LAYOUT_COMMON][name]]
        shard = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=dim)
        self.staged[local] = self._buffer(local)
        self.staged[local].copy_(shard)

    def _plan(self, layout: int) -> tuple[dict[str, Recipe], dict[str, list[str]]]:
        layout = _needs_table(layout)  # the common tensors' recipes are the same
        if layout not in self._recipes:
            ranks = ParallelRanks.from_model(unwrap_model(self.model))
            recipes = _hf_recipes(self.model, self.config, ranks, layout == LAYOUT_FUSED)
            consumers: dict[str, list[str]] = {}
            for param, recipe in recipes.items():
                for src in recipe.sources():
                    consumers.setdefault(src, []).append(param)
            self._recipes[layout], self._consumers[layout] = recipes, consumers
        return self._recipes[layout], self._consumers[layout]

    def _stage_hf(self, name: str, parts: dict[tuple, torch.Tensor], layout: int) -> None:
        if layout != LAYOUT_COMMON:
            self._layout = layout
        recipes, consumers = self._plan(layout)
        params = consumers.get(name)
        if not params:
            return  # another EP rank's expert, a tied lm_head, a rotary buffer
        pending = self.pending.tensors
        pending[name] = parts
        for param in params:
            recipe = recipes[param]
            if param not in self.staged and all(s in pending for s in recipe.sources()):
                staged = self._buffer(param)
                recipe.read_into(self.pending, staged)
                self.staged[param] = staged
        for src in list(pending):
            if all(p in self.staged for p in consumers[src]):
                del pending[src]

    def problem(self, partial: bool) -> str | None:
        """Why this rank cannot commit, or None."""
        if self.error is not None:
            return self.error
        if self.pending.tensors:
            recipes, consumers = self._plan(self._layout)
            waiting = sorted(self.pending.tensors)
            fused = {s for n in waiting for p in consumers[n] for s in recipes[p].sources()}
            return (
                f"tensors {waiting} were sent without the tensors fused with them on the "
                f"server: {sorted(fused - set(waiting))}"
            )
        missing = [p for p in self.params if p not in self.staged]
        if missing and not partial:
            return f"{len(missing)} of {len(self.params)} parameters not sent, e.g. {missing[:3]}"
        return None

    def _buffer(self, param: str) -> torch.Tensor:
        """A host tensor to stage parameter ``param`` into: its buffer, else a new one
        (page-locked for a CUDA parameter, so the commit's copy is a DMA transfer)."""
        target = self.params[param]
        buffer = self.buffers.pop(param, None)
        if buffer is not None and (buffer.shape, buffer.dtype) == (target.shape, target.dtype):
            return buffer
        pinned = target.device.type == "cuda"
        return torch.empty(target.shape, dtype=target.dtype, pin_memory=pinned)

    def apply(self) -> dict[str, torch.Tensor]:
        """Puts the staged shards into the model.

        A CPU parameter takes its staged tensor as its data (no copy: the swap between two
        steps is quick); a device parameter has it copied in, asynchronously from pinned
        memory, all copies waited for at once, then the staging tensors are freed
        (pinned pages included): a GPU replica keeps no host copy of its shard.

        Returns:
            The host tensors the next push may stage into (``buffers``): the replaced
            values of CPU parameters (those that had their own memory) and the buffers
            this push did not use.
        """
        freed, devices = self._put_staged()
        _release_pinned(devices)  # no staged tensor is referenced any more
        return {**self.buffers, **freed}  # with those a partial push did not use

    def _put_staged(self) -> tuple[dict[str, torch.Tensor], set[torch.device]]:
        """Swaps or copies every staged shard in and forgets them; returns the replaced
        CPU values (buffers for the next push) and the devices copied to."""
        freed, devices = {}, set()
        with torch.no_grad():
            for name, value in self.staged.items():
                param = self.params[name]
                if param.device.type == "cpu" and value.shape == param.shape:
                    old, param.data = param.data, value
                    if old.untyped_storage().nbytes() == old.numel() * old.element_size():
                        freed[name] = old  # its own memory, not part of a larger buffer
                else:
                    param.copy_(value, non_blocking=value.is_pinned())
                    devices.add(param.device)
        self.staged = {}
        return freed, devices

    def release(self) -> dict[str, torch.Tensor]:
        """An aborted push: the host tensors it held, for the next push to stage into."""
        return {**self.buffers, **self.staged}


def _release_pinned(devices: set[torch.device]) -> None:
    """Waits for the commit's copies to ``devices``, then hands the freed pinned staging
    memory back to the system (torch's host allocator would otherwise keep it cached)."""
    cuda = [d for d in devices if d.type == "cuda"]
    for device in cuda:
        torch.cuda.synchronize(device)
    if cuda:
        torch._C._host_emptyCache()


def _needs_table(layout: int) -> int:
    """The table of :attr:`WeightStaging.needs` a tensor of ``layout`` is in (a tensor
    common to both expert layouts has the same parts in each: the per-expert one)."""
    return LAYOUT_PER_EXPERT if layout == LAYOUT_COMMON else layout

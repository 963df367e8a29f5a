"""Weight pushes on every rank: stage this rank's shards of pushed tensors, swap on commit.

A push (``UpdateWeights``) arrives on rank 0 one full tensor at a time; rank 0
broadcasts each one (``protocol.Command.WEIGHTS_TENSOR``) and every rank cuts
its own shard out of it right away, with the recipes the checkpoint loaders use:

* HF names: :mod:`megascore.checkpoint.hf_names` maps every Megatron parameter
  to the HF tensors it is made of (fused QKV per query group, ``[gate; up]`` per
  TP rank, vocab-parallel rows, this EP rank's experts). A full HF tensor is kept
  only until every parameter that reads it has its shard (q, k and v arrive one
  after the other), then dropped.
* Megatron names (the unsharded local-spec model, experts by global index): the
  shard is cut as Megatron shards (:func:`megascore.model.weights.shard_full_tensor`).

Rank 0 checks names, shapes and dtypes before anything is broadcast, against what every
rank listed at WEIGHTS_BEGIN (:func:`weight_targets`, joined by :func:`gather_targets`:
each pipeline stage and EP rank knows only its own layers and experts).

Nothing touches the served parameters before the commit: the shards wait in
:class:`WeightStaging` (host memory, the parameters' dtype) while forward steps
keep running on the old weights. On WEIGHTS_COMMIT every rank checks that it can
commit (every parameter staged unless the push is partial; no half-sent fused
group; no staging error), the ranks agree (``step.agree_on_status``), and only
then does each put its shards in, between two engine steps: a CPU parameter takes
its staged tensor as is, a GPU one has it copied in.
"""

from __future__ import annotations

import json
import logging

import torch
import torch.distributed as dist

from megascore.checkpoint.hf_names import ParamMapper
from megascore.checkpoint.recipes import ParallelRanks, Recipe
from megascore.errors import CheckpointError
from megascore.model.config import ModelConfig
from megascore.model.weights import (
    canonical_shards,
    decoder_layer_offset,
    full_shape,
    shard_full_tensor,
    unwrap_model,
)
from megascore.types import (
    LAYOUT_COMMON,
    LAYOUT_FUSED,
    LAYOUT_PER_EXPERT,
    WEIGHT_NAMES_HF,
    WEIGHT_NAMES_MEGATRON,
    WeightTarget,
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


def _own(shard: torch.Tensor, param: torch.Tensor, pushed: set[int]) -> torch.Tensor:
    """``shard`` as it is staged for ``param``: in its dtype, contiguous.

    A CPU parameter takes the staged tensor itself at the commit (:meth:`WeightStaging.apply`),
    so the shard must own its memory: a view of a pushed tensor (whose storage is in
    ``pushed``; it may be the read-only bytes of a message) is copied, a tensor the recipe
    built (a concatenation, padded rows) is not. Elsewhere the commit copies the shard to
    the device, and only a view of part of a pushed tensor is copied now (it would keep
    the whole tensor alive).
    """
    storage = shard.untyped_storage()
    if param.device.type == "cpu":
        copy = storage.data_ptr() in pushed
    else:
        copy = storage.nbytes() != shard.numel() * shard.element_size()
    return shard.to(param.dtype, copy=copy).contiguous()


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


class _Pushed:
    """The reader interface recipes cut shards through, over the pushed full tensors."""

    directory = "the pushed weights"

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self.tensors[name][index]


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
    gets the union). Sent as UTF-8 JSON of names and shapes, never pickled.

    Args:
        local: this rank's targets, or None when it could not list them.
        group: every rank of the replica (gloo).
        config: the served architecture (a tied ``lm_head.weight`` is accepted, ignored).
        names: the push's name format.

    Raises:
        CheckpointError: on every rank, when some rank could not list its targets.
    """
    rows = None if local is None else [[n, t.shape, t.layout, t.ignored] for n, t in local.items()]
    payload = torch.frombuffer(bytearray(json.dumps(rows).encode()), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    union: dict[str, WeightTarget] = {}
    failed = []
    for rank, (part, n) in enumerate(zip(parts, sizes, strict=True)):
        rows = json.loads(part[: int(n.item())].numpy().tobytes())
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


class WeightStaging:
    """One rank's side of an open push: the staged shards, then the swap.

    Args:
        model: this rank's model (its parameters are replaced on :meth:`apply`).
        config: its architecture.
        pg_collection: its process groups.
        names: ``WEIGHT_NAMES_HF`` or ``WEIGHT_NAMES_MEGATRON``.
    """

    def __init__(self, model: torch.nn.Module, config: ModelConfig, pg_collection, names: int):
        self.model, self.config = model, config
        self.params = _parameters(model)
        self.staged: dict[str, torch.Tensor] = {}
        self.pending: dict[str, torch.Tensor] = {}  # HF tensors some shard still waits for
        self.error: str | None = None
        self._recipes: dict[int, dict[str, Recipe]] = {}
        self._consumers: dict[int, dict[str, list[str]]] = {}
        self._megatron = None
        self._layout = LAYOUT_COMMON  # the HF expert layout, once a tensor told it
        if names == WEIGHT_NAMES_MEGATRON:
            self._megatron = _megatron_layout(model, config, pg_collection)
        elif names != WEIGHT_NAMES_HF:
            raise ValueError(f"unknown weight name format {names}")

    def add(self, name: str, tensor: torch.Tensor, layout: int) -> None:
        """Stages this rank's shards of the full tensor ``name`` (if it needs any).

        A failure is recorded (reported by :meth:`problem` at commit time, when the
        ranks agree), never raised: the ranks must stay in step.
        """
        if self.error is not None:
            return
        try:
            if self._megatron is not None:
                self._add_megatron(name, tensor)
            else:
                self._add_hf(name, tensor, layout)
        except Exception as e:  # noqa: BLE001 - reported to every rank at the commit
            logger.exception("staging %r failed", name)
            self.error = f"staging {name!r} failed: {type(e).__name__}: {e}"

    def _add_megatron(self, name: str, tensor: torch.Tensor) -> None:
        entry = self._megatron.get(name)
        if entry is None:
            return  # another rank's (stage, expert)
        local, dim, stride, rank, size, _ = entry
        shard = shard_full_tensor(tensor, dim, stride, rank, size)  # a new tensor
        self.staged[local] = shard.to(self.params[local].dtype).contiguous()

    def _plan(self, layout: int) -> tuple[dict[str, Recipe], dict[str, list[str]]]:
        layout = LAYOUT_PER_EXPERT if layout == LAYOUT_COMMON else layout  # same recipes
        if layout not in self._recipes:
            ranks = ParallelRanks.from_model(unwrap_model(self.model))
            recipes = _hf_recipes(self.model, self.config, ranks, layout == LAYOUT_FUSED)
            consumers: dict[str, list[str]] = {}
            for param, recipe in recipes.items():
                for src in recipe.sources():
                    consumers.setdefault(src, []).append(param)
            self._recipes[layout], self._consumers[layout] = recipes, consumers
        return self._recipes[layout], self._consumers[layout]

    def _add_hf(self, name: str, tensor: torch.Tensor, layout: int) -> None:
        if layout != LAYOUT_COMMON:
            self._layout = layout
        recipes, consumers = self._plan(layout)
        params = consumers.get(name)
        if not params:
            return  # another EP rank's expert, a tied lm_head, a rotary buffer
        self.pending[name] = tensor
        reader = _Pushed(self.pending)
        for param in params:
            recipe = recipes[param]
            if param not in self.staged and all(s in self.pending for s in recipe.sources()):
                pushed = {t.untyped_storage().data_ptr() for t in self.pending.values()}
                self.staged[param] = _own(recipe.read(reader), self.params[param], pushed)
        for src in list(self.pending):
            if all(p in self.staged for p in consumers[src]):
                del self.pending[src]

    def problem(self, partial: bool) -> str | None:
        """Why this rank cannot commit, or None."""
        if self.error is not None:
            return self.error
        if self.pending:
            recipes, consumers = self._plan(self._layout)
            waiting = sorted(self.pending)
            fused = {s for n in waiting for p in consumers[n] for s in recipes[p].sources()}
            return (
                f"tensors {waiting} were sent without the tensors fused with them on the "
                f"server: {sorted(fused - set(waiting))}"
            )
        missing = [p for p in self.params if p not in self.staged]
        if missing and not partial:
            return f"{len(missing)} of {len(self.params)} parameters not sent, e.g. {missing[:3]}"
        return None

    def apply(self) -> int:
        """Puts the staged shards into the model; returns how many parameters changed.

        A CPU parameter takes its staged tensor as its data (no copy: the swap between two
        steps is quick, and the old values are freed); others are copied into (to the
        device).
        """
        with torch.no_grad():
            for name, value in self.staged.items():
                param = self.params[name]
                if param.device.type == "cpu" and value.shape == param.shape:
                    param.data = value
                else:
                    param.copy_(value)
        return len(self.staged)

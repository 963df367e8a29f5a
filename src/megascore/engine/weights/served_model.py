"""The model a replica serves: built from a model string, with its weights (start-up and
hot reload).

Model strings are :func:`megascore.checkpoint.parse_model_string`'s (built-ins
``NAME[@SEED]`` / ``builtin:NAME[@SEED]`` with deterministic random weights, the
weights version ``builtin:NAME@SEED``; checkpoints ``hf:DIR`` / ``megatron:DIR``,
resolved and loaded by :mod:`megascore.checkpoint`, the weights version the
checkpoint's label or a hash of its files' names, sizes and mtimes).

:func:`load_served_model` is the one path from a model string to a built model with
weights at start-up: a checkpoint's model is built without drawing random weights and
its loader writes every parameter once (:func:`build_agreeing`: on every rank, agreeing
that all did). :func:`reload_served_model` is the hot reload:
it first reads only the new model's architecture (no weight file opened) and refuses
another one (:func:`megascore.checkpoint.check_same_architecture`), then loads the new
weights into the served model's own parameters (no second model; the engine agrees
with the other ranks before the first write).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from megascore.api.errors import LOAD_FAILURES, WorkerLostError
from megascore.checkpoint import (
    ModelSpec,
    check_same_architecture,
    read_model_config,
    resolve_model,
)
from megascore.config import EngineConfig
from megascore.engine.ranks.distributed import collective_device
from megascore.engine.ranks.startup import load_agreeing
from megascore.engine.schedule.step import agree_on_status
from megascore.model.batch_invariant import make_batch_invariant
from megascore.model.build import build_model, draw_weights
from megascore.model.config import ModelConfig
from megascore.model.parallel import resolve_device

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadedModel:
    """A built model with its weights and what describes it.

    Attributes:
        spec: what it was loaded from (a checkpoint's ``path`` is its absolute directory).
        config: its architecture.
        model: this rank's ``GPTModel`` (eval mode).
        weights_version: label of the weights.
        num_parameters: parameters of the full (unsharded) model.
        has_tokenizer: a tokenizer file sits beside the checkpoint.
    """

    spec: ModelSpec
    config: ModelConfig
    model: torch.nn.Module
    weights_version: str
    num_parameters: int
    has_tokenizer: bool = False


def count_parameters(model: torch.nn.Module, pg_collection) -> int:
    """Parameters of the full model from one rank's shards.

    Args:
        model: this rank's model.
        pg_collection: its process groups (``tp``, ``expt_tp``, ``ep``).

    Returns:
        Sum over parameters of ``numel x`` the number of shards it is split into
        (TP or expert-TP for partitioned tensors, x EP for expert parameters),
        summed over the pipeline stages (collective over the default group when
        PP > 1); a later stage's copy of the word embedding (Megatron marks it
        ``shared``) is not counted twice.

    The sum runs on the default group, whose timeout is the start-up one
    (``megascore.engine.runtime``), not on the PP group (``collective_timeout_s``,
    120 s by default): the stages reach it when each has loaded its own layers, which
    for a large checkpoint can be minutes apart. Every rank of a stage counts the same
    total, so the sum over all ranks is ``world / PP`` times the sum over the stages.
    """

    def size(group) -> int:
        return 1 if group is None else group.size()

    total = 0
    for param in model.parameters():
        if getattr(param, "shared", False):
            continue
        is_expert = not getattr(param, "allreduce", True)
        factor = size(pg_collection.ep) if is_expert else 1
        if getattr(param, "tensor_model_parallel", False):
            factor *= size(pg_collection.expt_tp if is_expert else pg_collection.tp)
        total += param.numel() * factor
    pp = size(pg_collection.pp)
    if pp > 1:
        world = torch.distributed.group.WORLD
        count = torch.tensor([total], dtype=torch.int64, device=collective_device(world))
        torch.distributed.all_reduce(count, group=world)
        total = int(count.item()) * pp // torch.distributed.get_world_size(world)
    return total


def load_served_model(
    model: str,
    engine_cfg: EngineConfig,
    pg_collection,
    weights_version: str = "",
    before_write: Callable[[], None] | None = None,
    *,
    device: torch.device | None = None,
) -> LoadedModel:
    """Builds the model named by ``model`` on this rank and loads its weights (start-up).

    A checkpoint's model is built without random weights (its parameters are only
    allocated) and the loader writes each of them once, shard by shard; only built-ins
    draw theirs from the seed. The parameter count (collective over the PP group) is
    taken right after the build, before the stages spend unequal time loading.

    Args:
        model: a model string (:func:`megascore.checkpoint.parse_model_string`).
        engine_cfg: the engine config (parallel sizes, dtype, device, seed of built-ins).
        pg_collection: Megatron's process groups of this replica (``megatron:`` loading
            is collective over the replica).
        weights_version: label of the weights ("" takes the resolved one).
        before_write: passed to a checkpoint's loader: called once the checkpoint was
            checked against the built model, before its first write (the engine agrees
            with the other ranks there). Not called for a built-in.
        device: this rank's device (the engine's, resolved once at start-up); None
            resolves it from ``engine_cfg`` (a model built on its own).

    Returns:
        The :class:`LoadedModel`.

    Raises:
        ValueError: a malformed model string.
        CheckpointError: a checkpoint that is missing, corrupt or does not fit.
    """
    config, load_weights, meta = resolve_model(
        model, seed=engine_cfg.seed, ignore_mtp_layers=engine_cfg.ignore_mtp_layers
    )
    device = device or resolve_device(engine_cfg)
    built = build_model(
        config,
        dataclasses.replace(engine_cfg, seed=config.seed),
        pg_collection,
        random_weights=load_weights is None,
        device=device,
    )
    if engine_cfg.batch_invariant_on(device.type):
        make_batch_invariant(built)
    num_parameters = count_parameters(built, pg_collection)
    if load_weights is not None:
        load_weights(built, before_write)
    return LoadedModel(
        spec=ModelSpec(meta.kind, meta.name, path=meta.checkpoint_path),
        config=config,
        model=built,
        weights_version=weights_version or meta.weights_version,
        num_parameters=num_parameters,
        has_tokenizer=meta.has_tokenizer,
    )


def reload_served_model(
    served: LoadedModel,
    model: str,
    engine_cfg: EngineConfig,
    pg_collection,
    weights_version: str = "",
    before_write: Callable[[], None] | None = None,
) -> LoadedModel:
    """Loads the weights ``model`` names into the served model's own parameters (hot reload).

    The architecture is checked from the config first (no weight file opened), then the
    loader checks the checkpoint against the model and calls ``before_write`` before
    its first write; each parameter is then overwritten in place, one shard in flight,
    so no second model is ever built. A built-in (``builtin:NAME@SEED``) redraws its
    weights from the seed, also in place.

    Args:
        served: the model being served (its ``model`` is written).
        model: a model string of the same architecture.
        engine_cfg: the engine config (the seed of a built-in without ``@SEED``).
        pg_collection: the replica's process groups.
        weights_version: label of the weights ("" takes the resolved one).
        before_write: called once nothing is left to check, before the first write (the
            engine agrees with the other ranks there); what it raises ends the reload
            with the weights untouched.

    Returns:
        A new :class:`LoadedModel` describing ``served.model`` with its new weights.

    Raises:
        ValueError: a malformed model string.
        CheckpointError: another architecture, or a checkpoint that is missing,
            corrupt or does not fit: raised before the first write, the served
            weights untouched; or a read that failed midway (the weights partly written).
    """
    ignore_mtp = engine_cfg.ignore_mtp_layers
    # from the config (+ headers for optional parts), no tensor read
    check_same_architecture(
        read_model_config(model, ignore_mtp_layers=ignore_mtp), served.config, model
    )
    config, load_weights, meta = resolve_model(
        model, seed=engine_cfg.seed, ignore_mtp_layers=ignore_mtp
    )
    if load_weights is None:
        if before_write is not None:
            before_write()
        draw_weights(served.model, config, config.seed, pg_collection)
    else:
        load_weights(served.model, before_write)
    return dataclasses.replace(
        served,
        spec=ModelSpec(meta.kind, meta.name, path=meta.checkpoint_path),
        config=config,
        weights_version=weights_version or meta.weights_version,
        has_tokenizer=meta.has_tokenizer,
    )


def build_agreeing(
    engine_cfg: EngineConfig, pg_collection, load: dist.ProcessGroup, device: torch.device
) -> LoadedModel:
    """Builds and loads the served model on this rank; every rank agrees over ``load``
    that all did (a config or checkpoint error the same everywhere is raised as is)."""
    world_size = dist.get_world_size()

    def agree(problem: BaseException | None) -> None:
        failed = agree_on_status(problem is not None, load)
        if failed and isinstance(problem, LOAD_FAILURES) and len(failed) == world_size:
            raise problem  # a config / checkpoint error, the same everywhere
        if failed:
            raise WorkerLostError(f"building the model failed on ranks {failed}: {problem}")

    loaded, error = load_agreeing(
        lambda before_write: load_served_model(
            engine_cfg.model, engine_cfg, pg_collection, before_write=before_write, device=device
        ),
        agree,
        "building the model",
    )
    agree(error)  # every rank has built it
    return loaded

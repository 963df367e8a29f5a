"""The model a replica serves: built from a model string, with its weights (start-up and
hot reload).

Model strings are :func:`megascore.checkpoint.parse_model_string`'s (built-ins
``NAME[@SEED]`` / ``builtin:NAME[@SEED]`` with deterministic random weights, the
weights version ``builtin:NAME@SEED``; checkpoints ``hf:DIR`` / ``megatron:DIR``,
resolved and loaded by :mod:`megascore.checkpoint`, the weights version the
checkpoint's label or a hash of its files' names, sizes and mtimes).

:func:`load_served_model` is the one path from a model string to a built model with
weights, at start-up and on every hot reload (the engine then swaps it in once
every rank has it). With ``expected`` it first reads only the new model's
architecture (no model built, no weight file opened) and refuses another one
(:func:`megascore.checkpoint.check_same_architecture`).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from megascore.checkpoint import (
    ModelSpec,
    check_same_architecture,
    read_model_config,
    resolve_model,
)
from megascore.config import EngineConfig
from megascore.distributed import collective_device
from megascore.model.batch_invariant import make_batch_invariant
from megascore.model.build import build_model
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
    *,
    expected: ModelConfig | None = None,
) -> LoadedModel:
    """Builds the model named by ``model`` on this rank and loads its weights.

    The one place model strings turn into models (start-up and hot reload).

    Args:
        model: a model string (:func:`megascore.checkpoint.parse_model_string`).
        engine_cfg: the engine config (parallel sizes, dtype, device, seed of built-ins).
        pg_collection: Megatron's process groups of this replica (``megatron:`` loading
            is collective over the replica).
        weights_version: label of the weights ("" takes the resolved one).
        expected: the architecture the model must have (hot reload: the served one),
            checked from the config before anything is built or read.

    Returns:
        The :class:`LoadedModel`.

    Raises:
        ValueError: a malformed model string.
        CheckpointError: a checkpoint that is missing, corrupt or does not fit, or an
            architecture other than ``expected``.
    """
    ignore_mtp = engine_cfg.ignore_mtp_layers
    if expected is not None:  # from the config (+ headers for optional parts), no tensor read
        check_same_architecture(
            read_model_config(model, ignore_mtp_layers=ignore_mtp), expected, model
        )
    config, load_weights, meta = resolve_model(
        model, seed=engine_cfg.seed, ignore_mtp_layers=ignore_mtp
    )
    built = build_model(config, dataclasses.replace(engine_cfg, seed=config.seed), pg_collection)
    if engine_cfg.batch_invariant_on(resolve_device(engine_cfg).type):
        make_batch_invariant(built)
    if load_weights is not None:
        load_weights(built)
    return LoadedModel(
        spec=ModelSpec(meta.kind, meta.name, path=meta.checkpoint_path),
        config=config,
        model=built,
        weights_version=weights_version or meta.weights_version,
        num_parameters=count_parameters(built, pg_collection),
        has_tokenizer=meta.has_tokenizer,
    )

"""Model strings -> built models with weights (start-up and hot reload).

Model strings:

* ``NAME`` / ``NAME@SEED`` / ``builtin:NAME[@SEED]``: a built-in architecture
  (``megascore.model.config.BUILTIN_MODELS``) with deterministic random weights
  from ``SEED`` (default: ``EngineConfig.seed``, then the config's seed). The
  weights version is ``builtin:NAME@SEED``. Hot reload to another seed of the
  served architecture goes through the same path.
* ``hf:DIR`` / ``megatron:DIR``: checkpoints, resolved and loaded by
  :mod:`megascore.checkpoint` (HF safetensors of the supported families, or a
  Megatron distributed checkpoint with ``megascore.json``). The weights version is
  the checkpoint's label or a hash of its files' names, sizes and mtimes.

:func:`load_model_config_and_weights` is the one place to extend for new formats;
:func:`model_config` reads only the architecture (no model built, no weight file
opened), so a hot reload of another architecture is refused before any work
(:func:`megascore.checkpoint.check_same_architecture`).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from megascore.checkpoint import check_same_architecture, read_model_config
from megascore.config import EngineConfig
from megascore.model.build import build_model
from megascore.model.config import ModelConfig, builtin_model

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A parsed ``model`` string.

    Attributes:
        kind: "builtin", "hf" or "megatron".
        name: built-in name, or the checkpoint directory's name.
        seed: weight seed of a built-in (``@SEED``), None for the config's.
        path: checkpoint directory ("" for built-ins).
    """

    kind: str
    name: str
    seed: int | None = None
    path: str = ""


def parse_model_spec(spec: str) -> ModelSpec:
    """Parses ``NAME``, ``NAME@SEED``, ``builtin:NAME[@SEED]``, ``hf:DIR`` or ``megatron:DIR``.

    Args:
        spec: the model string.

    Returns:
        The :class:`ModelSpec`.

    Raises:
        ValueError: an empty path, unknown built-in name or a non-integer seed.
    """
    for kind in ("hf", "megatron"):
        if spec.startswith(kind + ":"):
            path = spec[len(kind) + 1 :]
            if not path:
                raise ValueError(f"model {spec!r}: empty checkpoint path")
            return ModelSpec(kind, os.path.basename(os.path.normpath(path)), path=path)
    name, _, seed = spec.removeprefix("builtin:").partition("@")
    builtin_model(name)  # raises ValueError for unknown names
    if seed and not seed.lstrip("-").isdigit():
        raise ValueError(f"model {spec!r}: the seed after '@' must be an integer")
    return ModelSpec("builtin", name, int(seed) if seed else None)


@dataclasses.dataclass
class LoadedModel:
    """A built model with its weights and what describes it.

    Attributes:
        spec: the parsed model string it came from.
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
        (TP or expert-TP for partitioned tensors, x EP for expert parameters).
    """

    def size(group) -> int:
        return 1 if group is None else group.size()

    total = 0
    for param in model.parameters():
        is_expert = not getattr(param, "allreduce", True)
        factor = size(pg_collection.ep) if is_expert else 1
        if getattr(param, "tensor_model_parallel", False):
            factor *= size(pg_collection.expt_tp if is_expert else pg_collection.tp)
        total += param.numel() * factor
    return total


def _builtin_config(spec: ModelSpec, engine_cfg: EngineConfig) -> ModelConfig:
    config = builtin_model(spec.name)
    seed = next(s for s in (spec.seed, engine_cfg.seed, config.seed) if s is not None)
    return dataclasses.replace(config, seed=seed)


def model_config(model: str, engine_cfg: EngineConfig) -> ModelConfig:
    """The architecture ``model`` names, from its config file only (cheap).

    Builds nothing and opens no weight file: ``config.json`` (``hf:``) or
    ``megascore.json`` (``megatron:``), or the built-in config.

    Raises:
        ValueError: an unknown model string.
        CheckpointError: a missing directory, a missing / corrupt / unsupported config.
    """
    spec = parse_model_spec(model)
    if spec.kind == "builtin":
        return _builtin_config(spec, engine_cfg)
    return read_model_config(model)


def load_model_config_and_weights(
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
        model: a model string (see :func:`parse_model_spec`).
        engine_cfg: the engine config (parallel sizes, dtype, device, seed override).
        pg_collection: Megatron's process groups of this replica.
        weights_version: label of the weights ("" derives ``builtin:NAME@SEED``).
        expected: the architecture the model must have (hot reload: the served one),
            checked from the config before anything is built or read.

    Returns:
        The :class:`LoadedModel`.

    Raises:
        ValueError: an unknown model string.
        CheckpointError: a checkpoint that is missing, corrupt or does not fit, or an
            architecture other than ``expected``.
    """
    spec = parse_model_spec(model)
    if spec.kind != "builtin":
        return _load_checkpoint(model, engine_cfg, pg_collection, weights_version, expected)
    config = _builtin_config(spec, engine_cfg)
    if expected is not None:
        check_same_architecture(config, expected, model)
    seed = config.seed
    built = build_model(config, dataclasses.replace(engine_cfg, seed=seed), pg_collection)
    return LoadedModel(
        spec=spec,
        config=config,
        model=built,
        weights_version=weights_version or f"builtin:{spec.name}@{seed}",
        num_parameters=count_parameters(built, pg_collection),
    )


def _load_checkpoint(
    model: str,
    engine_cfg: EngineConfig,
    pg_collection,
    weights_version: str,
    expected: ModelConfig | None,
) -> LoadedModel:
    """``hf:DIR`` / ``megatron:DIR``: builds the checkpoint's architecture, loads this
    rank's shards (``megatron:`` loading is collective over the replica)."""
    from megascore.checkpoint import resolve_model

    if expected is not None:  # from the config alone, before the weight files' headers
        check_same_architecture(read_model_config(model), expected, model)
    config, load_weights, meta = resolve_model(model)
    built = build_model(config, engine_cfg, pg_collection)
    load_weights(built)
    kind = parse_model_spec(model).kind
    return LoadedModel(
        spec=ModelSpec(kind, meta.name, path=meta.checkpoint_path),
        config=config,
        model=built,
        weights_version=weights_version or meta.weights_version,
        num_parameters=count_parameters(built, pg_collection),
        has_tokenizer=meta.has_tokenizer,
    )

"""Model strings -> (ModelConfig, weight loader, metadata).

A model string names what a replica serves (:func:`parse_model_string`, the one
grammar of megascore):

* ``NAME`` / ``NAME@SEED`` / ``builtin:NAME[@SEED]``: a built-in config
  (``tiny``, ``tiny-moe``, ``bench`` ...) with random weights drawn from ``SEED``
  (``build_model`` initialises them; nothing to load);
* ``hf:DIR``: a Hugging Face checkpoint (``config.json`` + safetensors);
* ``megatron:DIR``: a Megatron-Core distributed checkpoint with ``megascore.json``
  (see :mod:`megascore.checkpoint.megatron_ckpt`).

:func:`read_model_config` reads only the architecture (``config.json`` /
``megascore.json``), the cheapest check a hot reload can make first
(:func:`megascore.checkpoint.checks.check_same_architecture`, the one architecture
comparison of megascore).
:func:`resolve_model` reads only configs and file metadata (cheap, no weights),
so rank 0 can describe a model before building it. The returned ``load_weights``
runs on every rank after ``build_model`` (which then draws no random weights) and
loads that rank's shards into the model's own parameters, one at a time; it checks
the whole checkpoint against the model before overwriting any parameter, and calls
its ``before_write`` hook (the engine's agreement of the ranks) in between.

Every loader (megascore's HF recipes, megatron-bridge's mappings, Megatron
checkpoints) must write every parameter of the model exactly once:
:func:`megascore.checkpoint.checks.check_every_parameter_written` fails the load,
naming the parameters, when one would keep its random initial value or be written
twice. ``hf:`` checkpoints go
through megatron-bridge's ``AutoBridge`` only where it applies
(:mod:`megascore.checkpoint.hf_bridge`), else megascore's own reader.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from megascore.api.errors import CheckpointError
from megascore.checkpoint.hf_config import hf_config_to_model_config, read_hf_config
from megascore.checkpoint.optional_parts import served_head, served_mtp_layers
from megascore.model.config import BUILTIN_MODELS, ModelConfig, builtin_model

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
DTYPES = ("float32", "bfloat16", "float16")

WeightLoader = Callable[..., None]
"""``load_weights(model, before_write=None)``: loads this rank's shards into ``model``;
``before_write()`` runs once the checkpoint was checked, before the first write."""


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """What a model string resolved to (reported by GetModelInfo).

    Attributes:
        kind: "builtin", "hf" or "megatron".
        name: built-in name, or the checkpoint directory's name.
        checkpoint_path: absolute checkpoint directory ("" for built-ins).
        weights_version: identifies the weights: the ``megascore.json`` label, else a
            hash of the weight files' names, sizes and mtimes; ``builtin:NAME@SEED``
            for built-ins.
        has_tokenizer: a tokenizer file sits beside the weights.
        checkpoint_dtype: dtype the weights are stored in ("" when unknown).
    """

    kind: str
    name: str
    checkpoint_path: str = ""
    weights_version: str = ""
    has_tokenizer: bool = False
    checkpoint_dtype: str = ""


class ResolvedModel(NamedTuple):
    """Result of :func:`resolve_model`; unpacks as ``(config, load_weights, metadata)``."""

    model_config: ModelConfig
    load_weights: WeightLoader | None
    """Loads this rank's weights into a built model (collective for megatron:);
    None for built-ins, whose weights ``build_model`` draws from the seed."""
    metadata: CheckpointMetadata


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A parsed model string.

    Attributes:
        kind: "builtin", "hf" or "megatron".
        name: built-in name, or the checkpoint directory's name.
        seed: weight seed of a built-in (``@SEED``), None for the default.
        path: checkpoint directory as given ("" for built-ins).
    """

    kind: str
    name: str
    seed: int | None = None
    path: str = ""


def parse_model_string(model: str) -> ModelSpec:
    """Parses ``NAME``, ``NAME@SEED``, ``builtin:NAME[@SEED]``, ``hf:DIR`` or ``megatron:DIR``.

    Args:
        model: the model string.

    Returns:
        The :class:`ModelSpec`.

    Raises:
        ValueError: an empty directory, an unknown built-in name or a non-integer seed.
    """
    for kind in ("hf", "megatron"):
        if model.startswith(kind + ":"):
            path = model[len(kind) + 1 :]
            if not path:
                raise ValueError(f"model {model!r}: missing directory after '{kind}:'")
            return ModelSpec(kind, os.path.basename(os.path.normpath(path)), path=path)
    name, _, seed = model.removeprefix("builtin:").partition("@")
    if name not in BUILTIN_MODELS:
        raise ValueError(
            f"unknown model {model!r}: use a built-in name "
            f"({', '.join(sorted(BUILTIN_MODELS))}, optionally NAME@SEED), hf:DIR or megatron:DIR"
        )
    if seed and not seed.lstrip("-").isdigit():
        raise ValueError(f"model {model!r}: the seed after '@' must be an integer")
    return ModelSpec("builtin", name, int(seed) if seed else None)


def _directory(path: str, model: str) -> Path:
    try:
        directory = Path(path).expanduser().resolve()
        is_dir = directory.is_dir()
    except (OSError, ValueError) as e:  # a name too long, a NUL byte, ...
        raise CheckpointError(f"model {model!r}: bad checkpoint path: {e}") from e
    if not is_dir:
        raise CheckpointError(f"model {model!r}: {directory} is not a directory")
    return directory


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / f).is_file() for f in TOKENIZER_FILES)


def _hash(items: list[tuple[str, int, int]]) -> str:
    h = hashlib.sha1()
    for name, size, mtime in items:
        h.update(f"{name}\0{size}\0{mtime}\n".encode())
    return h.hexdigest()[:16]


def _hf_model_config(
    directory: Path, config: dict, ignore_mtp_layers: bool, reader=None
) -> ModelConfig:
    """The architecture of ``config`` (``DIR/config.json``), less the optional parts the
    files do not hold (their headers are read from ``reader``, or opened here)."""
    from megascore.checkpoint import fp8
    from megascore.checkpoint.safetensors_io import SafetensorsDir

    model_cfg = hf_config_to_model_config(config)
    if not (model_cfg.mtp_num_layers or model_cfg.share_embeddings_and_output_weights):
        return model_cfg  # nothing optional: config.json alone says it
    opened = SafetensorsDir(directory, fp8.block_size(config)) if reader is None else None
    with contextlib.nullcontext(reader) if opened is None else opened as files:
        names = set(files.names())  # headers only
    model_cfg = served_head(model_cfg, names, source=str(directory))
    return served_mtp_layers(model_cfg, names, ignore=ignore_mtp_layers, source=str(directory))


def _resolve_hf(directory: Path, ignore_mtp_layers: bool) -> ResolvedModel:
    from megascore.checkpoint import fp8
    from megascore.checkpoint.safetensors_io import SafetensorsDir

    config = read_hf_config(directory)
    with SafetensorsDir(directory, fp8.block_size(config)) as reader:  # headers + sizes only
        model_cfg = _hf_model_config(directory, config, ignore_mtp_layers, reader)
        files = reader.fingerprint()
    cfg_stat = (directory / "config.json").stat()
    # The resolved path is part of the version: two copies with equal names, sizes
    # and mtimes (cp -p, unpacked tarballs) must not report the same weights.
    version = _hash(
        [
            (str(directory.resolve()), 0, 0),
            ("config.json", cfg_stat.st_size, cfg_stat.st_mtime_ns),
            *files,
        ]
    )
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "")

    def load_weights(model, before_write: Callable[[], None] | None = None) -> None:
        from megascore.checkpoint import hf_bridge
        from megascore.checkpoint.hf_weights import load_hf_weights

        if hf_bridge.choose_hf_loader(model, directory) == "bridge":
            hf_bridge.load_with_bridge(model, directory, model_cfg, before_write)
        else:  # megascore's recipes: every architecture hf_config accepts
            load_hf_weights(model, model_cfg, directory, before_write=before_write)

    meta = CheckpointMetadata(
        "hf", directory.name, str(directory), version, _has_tokenizer(directory), dtype
    )
    return ResolvedModel(model_cfg, load_weights, meta)


def _resolve_megatron(directory: Path) -> ResolvedModel:
    from megascore.checkpoint import megatron_ckpt

    model_cfg, data = megatron_ckpt.read_checkpoint_config(directory)
    version = data.get("weights_version") or megatron_ckpt.checkpoint_fingerprint(directory)

    def load_weights(model, before_write: Callable[[], None] | None = None) -> None:
        megatron_ckpt.load_checkpoint(model, model_cfg, directory, before_write)

    meta = CheckpointMetadata(
        "megatron",
        directory.name,
        str(directory),
        str(version),
        _has_tokenizer(directory),
        str(data.get("dtype", "")),
    )
    return ResolvedModel(model_cfg, load_weights, meta)


def resolve_model(
    model: str, *, seed: int | None = None, ignore_mtp_layers: bool = False
) -> ResolvedModel:
    """Resolves a model string without reading any weights.

    The MTP layers a ``hf:`` checkpoint's files do not hold are left out of the
    architecture, and a stored output layer is served even where ``config.json`` ties it
    to the embedding (:mod:`megascore.checkpoint.optional_parts`).

    Args:
        model: a model string (:func:`parse_model_string`).
        seed: the weight seed of a built-in without ``@SEED`` (``EngineConfig.seed``);
            unset, the built-in config's own seed.
        ignore_mtp_layers: leave the MTP layers out (``EngineConfig.ignore_mtp_layers``).

    Returns:
        ``(model_config, load_weights, metadata)``.

    Raises:
        ValueError: a malformed model string.
        CheckpointError: a missing directory, missing/corrupt config or weight files,
            an unsupported architecture, or ``ignore_mtp_layers`` for a Megatron
            checkpoint with MTP layers.
    """
    spec = parse_model_string(model)
    if spec.kind == "builtin":
        cfg = _builtin_config(spec.name, ignore_mtp_layers)
        chosen = next(s for s in (spec.seed, seed, cfg.seed) if s is not None)
        cfg = dataclasses.replace(cfg, seed=chosen)
        version = f"builtin:{spec.name}@{chosen}"
        return ResolvedModel(cfg, None, CheckpointMetadata("builtin", spec.name, "", version))
    directory = _directory(spec.path, model)
    if spec.kind == "hf":
        resolved = _resolve_hf(directory, ignore_mtp_layers)
    else:
        resolved = _resolve_megatron(directory)
        _refuse_ignoring_megatron_mtp(resolved.model_config, ignore_mtp_layers, model)
    logger.info(
        "resolved %s: %s, weights version %s",
        model,
        resolved.model_config.architecture,
        resolved.metadata.weights_version,
    )
    return resolved


def _builtin_config(name: str, ignore_mtp_layers: bool) -> ModelConfig:
    cfg = builtin_model(name)
    return served_mtp_layers(cfg, (), ignore=True, source=name) if ignore_mtp_layers else cfg


def _refuse_ignoring_megatron_mtp(cfg: ModelConfig, ignore_mtp_layers: bool, model: str) -> None:
    if ignore_mtp_layers and cfg.mtp_num_layers:
        raise CheckpointError(
            f"model {model!r}: ignore_mtp_layers applies to hf: checkpoints and built-in "
            "models; a Megatron checkpoint is served with the MTP layers it was saved with"
        )


def read_model_config(model: str, *, ignore_mtp_layers: bool = False) -> ModelConfig:
    """The architecture a checkpoint model string names, from its config file only.

    Reads ``DIR/config.json`` (``hf:``; the weight files' headers too when it declares
    MTP layers or a tied output layer, see :func:`resolve_model`) or
    ``DIR/megascore.json`` (``megatron:``); no tensor data is read. Built-in names give
    their config.

    Raises:
        ValueError: a malformed model string.
        CheckpointError: missing directory, missing / corrupt config, or an
            unsupported architecture.
    """
    spec = parse_model_string(model)
    if spec.kind == "builtin":
        return _builtin_config(spec.name, ignore_mtp_layers)
    directory = _directory(spec.path, model)
    if spec.kind == "hf":
        return _hf_model_config(directory, read_hf_config(directory), ignore_mtp_layers)
    from megascore.checkpoint import megatron_ckpt

    cfg = megatron_ckpt.read_checkpoint_config(directory)[0]
    _refuse_ignoring_megatron_mtp(cfg, ignore_mtp_layers, model)
    return cfg


def torch_dtype(name: str):
    """ "float32" / "bfloat16" / "float16" -> the torch dtype."""
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    return getattr(torch, name)

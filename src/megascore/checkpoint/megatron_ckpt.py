"""Megatron-Core distributed checkpoints (``torch_dist``) plus a ``megascore.json``.

A megascore Megatron checkpoint directory holds what
``megatron.core.dist_checkpointing.save`` writes from the model's
``sharded_state_dict()`` (``metadata.json``, ``.metadata``, ``__*_*.distcp``)
and a ``megascore.json`` with the :class:`ModelConfig` and a weights version.
Because every tensor is stored with its global shape and offsets, the
checkpoint loads into any TP / CP / EP layout. Its keys are TransformerEngine's
(``megascore.checkpoint.megatron_names``: the local spec's norms renamed to where TE
keeps or fuses them, for dense, MoE and MLA layers), so a checkpoint of either
attention backend, or one Megatron-LM wrote with TE, loads into either backend;
checkpoints written with the local spec's keys (megascore before this map) still load.
Tensors convert to the model's dtype on load (an fp32 checkpoint serves in bf16).
Layers' ``_extra_state`` entries (TransformerEngine's FP8 metadata; empty
placeholders in Megatron's local layers, keyed differently by the two backends)
are neither saved nor loaded: megascore keeps no FP8 state, and a checkpoint
saved with one backend would otherwise miss the other's entries.

``megascore.json`` is written last, so a directory without it is incomplete.
Loading first checks the checkpoint's metadata against the model (every tensor there
with its global shape, no data file cut short), so such a checkpoint leaves the model
unchanged; then Megatron reads each shard straight into the model's own tensors.

All functions here are collective over the default process group (the replica).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
from megatron.core.dist_checkpointing.validation import StrictHandling
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from megascore.api.errors import CheckpointError
from megascore.checkpoint.checks import (
    check_every_parameter_written,
    check_same_architecture,
    model_tensor_names,
)
from megascore.checkpoint.megatron_names import te_keys
from megascore.engine.ranks.distributed import collective_device
from megascore.model.config import ModelConfig
from megascore.model.weights import unwrap_model

logger = logging.getLogger(__name__)

CONFIG_FILE = "megascore.json"
FORMAT = "megascore-megatron/1"
_MARKER = "metadata.json"  # written by dist_checkpointing.save when complete


def _weights_only(sharded: dict[str, Any]) -> dict[str, Any]:
    """The sharded state dict without the layers' ``_extra_state`` entries (module docstring)."""
    return {k: v for k, v in sharded.items() if not k.endswith("_extra_state")}


def _sharded_entries(sharded: dict[str, Any]) -> list[Any]:
    return [v for v in sharded.values() if isinstance(v, ShardedTensor | ShardedTensorFactory)]


def _to_te_keys(sharded: dict[str, Any], stored: set[str] | None = None) -> None:
    """Renames the entries' checkpoint keys to TransformerEngine's (module docstring).

    With ``stored`` (the keys of a checkpoint being loaded), a TE key the checkpoint
    lacks keeps its local name where the checkpoint has that one (older checkpoints).
    """
    entries = _sharded_entries(sharded)
    renamed = te_keys(e.key for e in entries)
    for entry in entries:
        new = renamed.get(entry.key)
        if new is not None and (stored is None or new in stored or entry.key not in stored):
            entry.key = new


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def config_to_json(model_cfg: ModelConfig) -> dict[str, Any]:
    """The :class:`ModelConfig` as a JSON-able dict."""
    return dataclasses.asdict(model_cfg)


def config_from_json(data: dict[str, Any], source: str) -> ModelConfig:
    """Rebuilds a :class:`ModelConfig`, rejecting unknown fields (a newer format)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise CheckpointError(f"{source}: unknown model config fields {unknown}")
    try:
        return ModelConfig(**data)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: invalid model config: {e}") from e


def read_checkpoint_config(directory: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """Reads ``DIR/megascore.json``.

    Args:
        directory: checkpoint directory.

    Returns:
        ``(model config, the whole JSON object)``.

    Raises:
        CheckpointError: missing/corrupt file, unknown format, or incomplete checkpoint.
    """
    directory = Path(directory)
    path = directory / CONFIG_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: missing; not a megascore Megatron checkpoint (or an incomplete save)"
        ) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown format {data.get('format')!r}, want {FORMAT!r}")
    if not (directory / _MARKER).is_file():
        raise CheckpointError(f"{directory}: no {_MARKER}: incomplete distributed checkpoint")
    return config_from_json(data.get("model_config") or {}, str(path)), data


def checkpoint_fingerprint(directory: str | Path) -> str:
    """Hash of the checkpoint's file names, sizes and mtimes (a cheap weights version)."""
    h = hashlib.sha1()
    for path in sorted(Path(directory).iterdir()):
        if path.is_file():
            st = path.stat()
            h.update(f"{path.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def save_checkpoint(
    model: torch.nn.Module,
    model_cfg: ModelConfig,
    directory: str | Path,
    *,
    weights_version: str | None = None,
) -> None:
    """Saves ``model`` as a Megatron distributed checkpoint plus ``megascore.json``.

    Collective: every rank of the replica calls it with the same arguments.

    Args:
        model: the built (possibly wrapped) GPTModel of this rank.
        model_cfg: its architecture.
        directory: target directory; created if needed, must be empty.
        weights_version: optional label stored in ``megascore.json`` and reported
            by the server (default: a fingerprint of the files).

    Raises:
        CheckpointError: the directory is not empty.
    """
    directory = Path(directory)
    not_empty = 0
    if _rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        not_empty = int(any(directory.iterdir()))
    if dist.is_initialized():  # every rank raises, or none does
        flag = torch.tensor([not_empty], device=collective_device(dist.group.WORLD))
        dist.all_reduce(flag)
        not_empty = int(flag.item())
    if not_empty:
        raise CheckpointError(f"{directory}: not empty; refusing to overwrite")
    sharded = _weights_only(unwrap_model(model).sharded_state_dict())
    _to_te_keys(sharded)
    dist_checkpointing.save(sharded, str(directory))
    if _rank() == 0:
        dtype = next(unwrap_model(model).parameters()).dtype
        data = {
            "format": FORMAT,
            "model_config": config_to_json(model_cfg),
            "weights_version": weights_version or "",
            "dtype": str(dtype).removeprefix("torch."),
            "saved_world_size": dist.get_world_size() if dist.is_initialized() else 1,
        }
        tmp = directory / (CONFIG_FILE + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")
        os.replace(tmp, directory / CONFIG_FILE)
    _barrier()
    logger.info("saved Megatron checkpoint to %s", directory)


def _check_against_checkpoint(module: torch.nn.Module, directory: Path) -> set[str]:
    """Checks, from the checkpoint's metadata alone, that a load would fill every tensor
    of this rank: each shard's key (as :func:`_to_te_keys` maps it) stored with the
    global shape the model expects, and every data file long enough for the byte ranges
    the metadata names (a truncated file). Nothing is read but the metadata.

    Returns:
        The checkpoint's tensor keys.
    """
    try:
        stored = dist_checkpointing.load_tensors_metadata(str(directory))
        storage = FileSystemReader(str(directory)).read_metadata().storage_data
    except (Exception, CheckpointException) as e:  # see load_checkpoint
        raise CheckpointError(f"{directory}: cannot read checkpoint metadata: {e}") from e
    needed: dict[str, int] = {}
    for info in storage.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for rel, end in sorted(needed.items()):
        size = (directory / rel).stat().st_size if (directory / rel).is_file() else -1
        if size < end:
            raise CheckpointError(
                f"{directory}: cannot load distributed checkpoint: {rel} holds {max(size, 0)} "
                f"bytes, the metadata names bytes up to {end} (truncated or missing)"
            )
    raw = _weights_only(module.sharded_state_dict())
    _to_te_keys(raw, set(stored))
    sharded, _, _ = load_preprocess(raw)
    written, wrong = [], []
    for name, entry in sharded.items():
        values = nested_values(entry) if isinstance(entry, dict | list) else [entry]
        shards = [s for s in values if isinstance(s, ShardedTensor)]
        if not shards or any(s.key not in stored for s in shards):
            continue
        bad = [s for s in shards if tuple(stored[s.key].global_shape) != tuple(s.global_shape)]
        if bad:
            s = bad[0]
            wrong.append(f"{s.key} {tuple(stored[s.key].global_shape)} != {tuple(s.global_shape)}")
        written.append(name)
    if wrong:
        raise CheckpointError(
            f"{directory}: tensors stored with other shapes than the model's: {wrong[:8]}"
        )
    check_every_parameter_written(model_tensor_names(module), written, str(directory))
    return set(stored)


def load_checkpoint(
    model: torch.nn.Module,
    model_cfg: ModelConfig,
    directory: str | Path,
    before_write: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Loads a checkpoint written by :func:`save_checkpoint` into ``model`` (any layout).

    Collective over the replica. First checks the checkpoint's config and metadata
    against the model (architecture, every tensor present with its global shape, no
    data file shorter than its metadata says); then Megatron reads each shard straight
    into the model's own tensor (no second copy of the model).

    Args:
        model: the built (possibly wrapped) GPTModel of this rank.
        model_cfg: the architecture the model was built from.
        directory: the checkpoint directory.
        before_write: called once the checks passed, before anything is written (the
            engine agrees with the other ranks there); what it raises ends the load with
            the model untouched.

    Returns:
        The checkpoint's ``megascore.json`` object.

    Raises:
        CheckpointError: incomplete or corrupt checkpoint, different architecture,
            a tensor missing from the checkpoint, or a shape mismatch: found before
            anything is written, the model is then unchanged. Damaged data found while
            reading (or tensors the model does not have) leave the model partly written.
    """
    directory = Path(directory)
    ckpt_cfg, data = read_checkpoint_config(directory)
    check_same_architecture(ckpt_cfg, model_cfg, str(directory))
    module = unwrap_model(model)
    stored = _check_against_checkpoint(module, directory)
    if before_write is not None:
        before_write()
    sharded = _weights_only(module.sharded_state_dict())
    try:
        _to_te_keys(sharded, stored)
        loaded, missing, _ = dist_checkpointing.load(
            sharded, str(directory), strict=StrictHandling.RETURN_ALL
        )
    except CheckpointError:
        raise
    # torch DCP's CheckpointException derives from BaseException; Megatron raises
    # CheckpointingException; a damaged file surfaces as OSError / pickle errors.
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"{directory}: cannot load distributed checkpoint: {e}") from e
    # Megatron's "missing" keys are in the checkpoint but not in the model.
    extra = sorted(k for k in missing if not k.endswith("_extra_state"))
    if extra:
        raise CheckpointError(f"{directory}: tensors the model does not have: {extra[:8]}")
    state = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for name in model_tensor_names(module):
            if loaded[name].data_ptr() != state[name].data_ptr():  # merged by a factory
                state[name].copy_(loaded[name])
    logger.info("loaded Megatron checkpoint %s", directory)
    return data

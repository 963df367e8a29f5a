"""HF safetensors -> Megatron-Core GPTModel parameters, sharded for this rank.

For every entry of the model's ``state_dict`` a *recipe* (from
``megascore.checkpoint.hf_names``) says which HF tensors it comes from and how this
rank's shard is cut out of them:

* ``linear_qkv`` is fused per query group: for each of the rank's groups the
  group's query heads, then its key head, then its value head
  (``[ng/tp, (nh/ng + 2) * d, hidden]``). Tensor parallelism splits the groups.
* ``linear_fc1`` of a SwiGLU MLP (and of each expert) is ``[gate; up]`` *per
  rank*: rank r holds rows r of the gate projection, then rows r of the up one.
* Row-parallel weights (``linear_proj``, ``linear_fc2``) split their input dim.
* The embedding and output layer split the vocabulary; rows past the checkpoint
  vocabulary (Megatron vocab padding) are zero.
* Multi-latent attention, router expert biases, shared experts and MTP layers: see
  ``hf_names`` and docs/checkpoints.md. The MTP layers' copies of the embedding and
  output layer must equal the main ones (checked on this rank's rows while staging).
* Experts: rank e of the expert-parallel group holds experts
  ``[e * E/ep, (e+1) * E/ep)``; inside an expert the expert-TP group splits as above.
* Block-scaled FP8 weights (DeepSeek-V3's layout, ``megascore.checkpoint.fp8``) are
  dequantised as they are read, each rank only its rows / columns, then cast to the
  parameter's dtype like any other tensor.

Everything is checked from the file headers (names, shapes, sizes) before any
data is read, so a checkpoint that does not fit leaves the model untouched; then each
local shard is read and copied into its parameter in turn (the model plus one shard in
memory).
(Where megatron-bridge applies, ``megascore.checkpoint.hf_bridge`` loads instead.)
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch

from megascore.api.errors import CheckpointError
from megascore.checkpoint import fp8
from megascore.checkpoint.checks import check_every_parameter_written, model_tensor_names
from megascore.checkpoint.hf_config import read_hf_config
from megascore.checkpoint.hf_names import ParamMapper, mtp_copies
from megascore.checkpoint.optional_parts import explain_missing
from megascore.checkpoint.recipes import ParallelRanks, Recipe
from megascore.checkpoint.safetensors_io import SafetensorsDir
from megascore.model.config import ModelConfig
from megascore.model.weights import decoder_layer_offset, unwrap_model

logger = logging.getLogger(__name__)

_IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$")


@dataclasses.dataclass
class HFLoadPlan:
    """Validated recipes for every parameter of one model on this rank."""

    directory: Path
    recipes: dict[str, Recipe]
    """Megatron state-dict name -> recipe producing this rank's tensor."""
    unused: list[str]
    """HF tensors no recipe reads."""
    copies: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(MTP layer copy, main tensor) pairs that must be equal: Megatron's MTP layers use
    the main model's embedding and output layer."""


def plan_hf_load(
    model: torch.nn.Module,
    model_cfg: ModelConfig,
    reader: SafetensorsDir,
    only: set[str] | None = None,
) -> HFLoadPlan:
    """Builds and validates the recipes for every parameter of ``model`` on this rank.

    Reads only file headers. Checks that each HF tensor exists with the shape the
    architecture implies and that each local shard matches the model's parameter.

    Args:
        model: the built GPTModel (possibly wrapped) on this rank.
        model_cfg: its architecture (the checkpoint's ``config.json`` translation).
        reader: the checkpoint's safetensors files.
        only: plan these parameters only (the rest is written by another loader).

    Returns:
        The validated plan.

    Raises:
        CheckpointError: missing tensor, wrong shape, vocabulary mismatch, or a
            model parameter without a known HF source.
    """
    model = unwrap_model(model)
    ranks = ParallelRanks.from_model(model)
    embed = "model.embed_tokens.weight"
    if embed in reader and reader.shape(embed)[0] != model_cfg.vocab_size:
        raise CheckpointError(
            f"{reader.file(embed)}: vocab mismatch: tensor {embed!r} has "
            f"{reader.shape(embed)[0]} rows but the model's vocab_size is {model_cfg.vocab_size}"
        )
    mapper = ParamMapper(model_cfg, reader, ranks)
    offset = decoder_layer_offset(model)
    recipes: dict[str, Recipe] = {}
    used: set[str] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state") or (only is not None and name not in only):
            continue
        recipe = mapper(name, offset)
        recipe.fit(tuple(tensor.shape))
        try:
            recipe.validate(reader, name)
        except CheckpointError as e:
            why = [explain_missing(model_cfg, s) for s in recipe.sources() if s not in reader]
            if any(why):
                raise CheckpointError(f"{e}: {next(filter(None, why))}") from None
            raise
        if tuple(tensor.shape) != recipe.local_shape():
            raise CheckpointError(
                f"Megatron parameter {name!r} has shape {tuple(tensor.shape)} on this rank but "
                f"the checkpoint ({', '.join(recipe.sources())}) gives {recipe.local_shape()}"
            )
        recipes[name] = recipe
        used.update(recipe.sources())
    copies = mtp_copies(model_cfg, reader)
    used.update(copy for copy, _ in copies)
    unused = [n for n in reader.names() if n not in used and not _IGNORED_HF.match(n)]
    if only is not None:
        unused = []
    if unused:
        logger.warning(
            "%s: %d HF tensors unused, e.g. %s", reader.directory, len(unused), unused[:5]
        )
    return HFLoadPlan(reader.directory, recipes, unused, copies)


def _check_copies(plan: HFLoadPlan, reader: SafetensorsDir, ranks: ParallelRanks) -> None:
    """Checks this rank's share of rows of every MTP copy against the main tensor."""
    for copy, main in plan.copies:
        rows = reader.shape(main)[0]
        per = -(-rows // ranks.tp_size)
        start, stop = ranks.tp_rank * per, min(rows, (ranks.tp_rank + 1) * per)
        index = (slice(start, stop),)
        if stop > start and not torch.equal(reader.read(copy, index), reader.read(main, index)):
            raise CheckpointError(
                f"{reader.directory}: {copy!r} differs from {main!r}; Megatron's MTP layers "
                "use the main model's embedding and output layer, so a checkpoint whose MTP "
                "copies differ cannot be served"
            )


def load_hf_weights(
    model: torch.nn.Module,
    model_cfg: ModelConfig,
    directory: str | Path,
    before_write: Callable[[], None] | None = None,
    only: set[str] | None = None,
) -> None:
    """Validates, then loads a HF safetensors checkpoint into ``model`` on this rank.

    Each parameter is read (this rank's shard only) and copied into the model's own
    tensor before the next one is read: peak memory is the model plus one shard.

    Args:
        model: the built (possibly wrapped) GPTModel of this rank.
        model_cfg: the architecture the model was built from.
        directory: HF checkpoint directory (``config.json`` + safetensors).
        before_write: called once everything was checked, before the first parameter
            is written (the engine agrees with the other ranks there); what it raises
            ends the load with the model untouched.
        only: load these parameters only (megatron-bridge wrote the others).

    Raises:
        CheckpointError: the checkpoint does not fit the model, or a parameter has no
            recipe (found before any parameter is written: the model is then unchanged);
            or a read failed midway (the model is then partly written).
    """
    directory = Path(directory)
    block = fp8.block_size(read_hf_config(directory))
    with SafetensorsDir(directory, block) as reader:
        plan = plan_hf_load(model, model_cfg, reader, only)
        expected = model_tensor_names(unwrap_model(model)) if only is None else sorted(only)
        check_every_parameter_written(expected, plan.recipes, str(directory))
        _check_copies(plan, reader, ParallelRanks.from_model(unwrap_model(model)))
        if before_write is not None:
            before_write()
        targets = unwrap_model(model).state_dict(keep_vars=True)
        with torch.no_grad():
            for name, recipe in plan.recipes.items():
                recipe.read_into(reader, targets[name])
    logger.info("loaded %d tensors from %s", len(plan.recipes), directory)

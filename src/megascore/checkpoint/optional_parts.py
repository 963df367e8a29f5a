"""Parts of a model that a saved HF checkpoint may lack (torch-free).

Trainers save through transformers, which keeps what its own model class holds:

* **MTP layers.** DeepSeek-V3 / GLM-4.5 configs declare ``num_nextn_predict_layers``
  MTP layers, stored after the decoder as ``model.layers.{num_hidden_layers + i}.*``;
  transformers builds none and drops them when it saves, keeping the declaration. The
  logprobs do not need them, so :func:`served_mtp_layers` serves the model without the
  MTP layers the files do not hold (from the first missing one on: each MTP layer reads
  the previous one's output), with a warning naming them (a layer stored in part is
  refused naming the missing tensor: :func:`explain_missing`); ``ignore_mtp_layers``
  (``--ignore-mtp-layers``) leaves out stored ones too. ``ModelInfo.mtp_metric_names``
  is then empty and a request for MTP metrics is refused (INVALID_ARGUMENT) with the
  reason (:attr:`ModelConfig.mtp_not_served`).
* **The output layer**, tied (``tie_word_embeddings``) or not, stored the other way.
  A tied model whose files hold ``lm_head.weight`` beside the embedding is served with
  that stored head (:func:`served_head`: transformers does the same when the two
  differ, and equal ones give the same logprobs); a tied model whose files hold only
  ``lm_head.weight`` takes the embedding from it (:func:`shared_embedding_name`: it is
  the same tensor); an untied model without ``lm_head.weight`` is refused naming it
  (:func:`explain_missing`): the logprobs need its output layer.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection

from megascore.model.config import ModelConfig

logger = logging.getLogger(__name__)

EMBEDDING = "model.embed_tokens.weight"
OUTPUT_LAYER = "lm_head.weight"


def _mtp_prefix(cfg: ModelConfig, index: int) -> str:
    return f"model.layers.{cfg.num_layers + index}."


def served_mtp_layers(
    cfg: ModelConfig, names: Collection[str], *, ignore: bool, source: str
) -> ModelConfig:
    """``cfg`` with the MTP layers that will be served: the leading ones the files hold
    (none with ``ignore``); logs a warning naming those left out.

    Args:
        cfg: the architecture ``config.json`` declares.
        names: the tensor names the checkpoint's files hold.
        ignore: leave out every MTP layer (``EngineConfig.ignore_mtp_layers``).
        source: the checkpoint, for the messages.

    Returns:
        ``cfg`` unchanged when every declared MTP layer is served; else a copy with
        ``mtp_num_layers`` lowered (None for none) and ``mtp_not_served`` set.
    """
    declared = cfg.mtp_num_layers or 0
    if not declared:
        return cfg
    stored = 0
    while stored < declared and any(n.startswith(_mtp_prefix(cfg, stored)) for n in names):
        stored += 1
    kept = 0 if ignore else stored
    if kept == declared:
        return cfg
    dropped = [f"{_mtp_prefix(cfg, i)}*" for i in range(kept, declared)]
    if ignore:
        why = "ignore_mtp_layers is set"
    else:
        why = (
            f"config.json declares {declared} MTP layer(s) (num_nextn_predict_layers); the "
            f"weight files hold {stored} (checkpoints saved by transformers drop them)"
        )
    not_served = f"{source}: {why}; not served: {', '.join(dropped)}"
    logger.warning("%s; serving without them (logprobs do not use MTP layers)", not_served)
    return dataclasses.replace(cfg, mtp_num_layers=kept or None, mtp_not_served=not_served)


def served_head(cfg: ModelConfig, names: Collection[str], *, source: str) -> ModelConfig:
    """``cfg`` untied when it ties the output layer to the embedding but the files hold
    both ``model.embed_tokens.weight`` and ``lm_head.weight`` (logs a warning)."""
    tied = cfg.share_embeddings_and_output_weights
    if not (tied and EMBEDDING in names and OUTPUT_LAYER in names):
        return cfg
    logger.warning(
        "%s: config.json ties the output layer to the embedding (tie_word_embeddings=true) "
        "but the weight files hold %s too: serving the stored %s as the output layer "
        "(as transformers does when the two differ)",
        source,
        OUTPUT_LAYER,
        OUTPUT_LAYER,
    )
    return dataclasses.replace(cfg, share_embeddings_and_output_weights=False)


def shared_embedding_name(cfg: ModelConfig, names: Collection[str]) -> str:
    """The HF tensor of the embedding (and, tied, of the output layer): ``lm_head.weight``
    for a tied model whose files hold only that one, else ``model.embed_tokens.weight``."""
    tied = cfg.share_embeddings_and_output_weights
    if tied and EMBEDDING not in names and OUTPUT_LAYER in names:
        return OUTPUT_LAYER
    return EMBEDDING


def explain_missing(cfg: ModelConfig, tensor: str) -> str:
    """Why a missing tensor of an optional part is needed ("" for other tensors)."""
    if tensor == OUTPUT_LAYER and not cfg.share_embeddings_and_output_weights:
        return (
            "config.json declares an untied output layer (tie_word_embeddings=false), which "
            "the logprobs need; if the checkpoint was saved with tied embeddings, set "
            "tie_word_embeddings to true in its config.json"
        )
    if any(tensor.startswith(_mtp_prefix(cfg, i)) for i in range(cfg.mtp_num_layers or 0)):
        return (
            "the files hold this MTP layer (num_nextn_predict_layers) only in part; "
            "--ignore-mtp-layers serves the model without its MTP layers"
        )
    return ""

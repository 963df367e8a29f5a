"""megatron-bridge's ``AutoBridge`` as the loader of ``hf:`` checkpoints, where it applies.

megatron-bridge is opt-in (``pip install --no-deps megatron-bridge`` plus the
``bridge`` extra, docs/deploy.md) and imported lazily, on the first HF load that
could use it. :func:`choose_hf_loader` takes it only when all of these hold:

* ``MEGASCORE_HF_LOADER`` is not ``native``;
* the model uses the TransformerEngine layer spec (the parameter names the bridge's
  mappings know; the ``torch`` backend's names differ);
* ``megatron.bridge`` imports (it needs TransformerEngine, hence CUDA); why it does
  not is logged once;
* ``AutoBridge.can_handle(DIR)``: it has a bridge for the checkpoint's architecture
  (it has none for Mixtral);
* the weights are not block-scaled FP8 (``quantization_config``): megascore's reader
  dequantises those (``megascore.checkpoint.fp8``).

Otherwise megascore's own reader (``megascore.checkpoint.hf_weights``, every family
``hf_config`` accepts) loads the checkpoint. ``MEGASCORE_HF_LOADER=bridge`` turns a
missing condition into an error instead of the fallback.

Before the bridge writes anything, its conversion tasks
(``AutoBridge.get_conversion_tasks``: one per parameter it will fill) must cover
every parameter of the model exactly once
(:func:`megascore.checkpoint.checks.check_every_parameter_written`): the bridge
itself only logs the parameters it has no mapping for, which would keep their
random initial values.

With tied embeddings under pipeline parallelism the last stage holds its own copy of the
embedding as ``output_layer.weight`` (Megatron's ``setup_embeddings_and_output_layer``);
a tied checkpoint has no ``lm_head.weight`` for it, and the bridge leaves tied output
layers out of its tasks. megascore writes that copy itself from
``model.embed_tokens.weight`` (:func:`written_by_megascore`, each TP rank its vocabulary
rows), so the stage does not depend on the bridge's broadcast of shared embeddings.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from megascore.api.errors import CheckpointError
from megascore.checkpoint.checks import check_every_parameter_written, model_tensor_names
from megascore.checkpoint.hf_config import read_hf_config

logger = logging.getLogger(__name__)

LOADER_ENV = "MEGASCORE_HF_LOADER"
LOADERS = ("auto", "native", "bridge")


@functools.cache
def import_auto_bridge() -> tuple[type | None, str]:
    """``(AutoBridge, "")``, or ``(None, why megatron.bridge does not import)`` (logged once)."""
    try:
        from megatron.bridge import AutoBridge
    except Exception as e:  # noqa: BLE001 - ImportError, or TE failing to find CUDA libraries
        why = f"{type(e).__name__}: {e}"
        absent = isinstance(e, ModuleNotFoundError) and e.name in ("megatron.bridge", "megatron")
        # Installed but broken (a missing dependency, TE without CUDA) deserves a warning.
        logger.log(
            logging.INFO if absent else logging.WARNING,
            "megatron-bridge is not usable (%s); hf: checkpoints use megascore's reader",
            why,
        )
        return None, why
    return AutoBridge, ""


def have_bridge() -> bool:
    """Whether megatron-bridge imports here (``HAVE_BRIDGE``)."""
    return import_auto_bridge()[0] is not None


def _unwrap(model):
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def _why_not_bridge(model, directory: Path) -> str | None:
    """None when the bridge can load ``directory`` into ``model``, else the reason."""
    backend = getattr(_unwrap(model), "megascore_attention_backend", None)
    if backend != "te":
        return f"attention backend {backend!r} (the bridge maps TransformerEngine-spec names)"
    if "quantization_config" in read_hf_config(directory):
        return "block-scaled FP8 weights (megascore's reader dequantises them)"
    auto_bridge, why = import_auto_bridge()
    if auto_bridge is None:
        return f"megatron-bridge does not import ({why})"
    if not auto_bridge.can_handle(str(directory)):
        architectures = read_hf_config(directory).get("architectures")
        return f"megatron-bridge has no bridge for {architectures}"
    return None


def choose_hf_loader(model, directory: str | Path) -> str:
    """Which loader fills ``model`` from the HF checkpoint ``directory`` (module docstring).

    Returns:
        "bridge" or "native".

    Raises:
        CheckpointError: ``MEGASCORE_HF_LOADER`` is unknown, or is ``bridge`` where the
            bridge cannot load this checkpoint into this model.
    """
    mode = os.environ.get(LOADER_ENV, "auto")
    if mode not in LOADERS:
        raise CheckpointError(f"{LOADER_ENV} must be one of {LOADERS}, got {mode!r}")
    if mode == "native":
        return "native"
    why = _why_not_bridge(model, Path(directory))
    if why is None:
        return "bridge"
    if mode == "bridge":
        raise CheckpointError(f"{directory}: {LOADER_ENV}=bridge, but {why}")
    logger.info("%s: megascore's HF reader: %s", directory, why)
    return "native"


def written_by_megascore(module) -> dict[str, str]:
    """Parameters of this stage that megascore writes instead of the bridge, with their HF
    tensor: a tied last pipeline stage's ``output_layer.weight`` is the embedding
    (``model.embed_tokens.weight``; the checkpoint has no ``lm_head.weight``)."""
    tied = getattr(module, "share_embeddings_and_output_weights", False)
    if tied and getattr(module, "post_process", False) and not getattr(module, "pre_process", True):
        return {"output_layer.weight": "model.embed_tokens.weight"}
    return {}


def load_with_bridge(model, directory: str | Path, model_cfg, before_write=None) -> None:
    """Loads ``directory`` with ``AutoBridge`` after checking its mappings cover the model.

    Args:
        model: the built (possibly wrapped) GPTModel of this rank.
        directory: HF checkpoint directory.
        model_cfg: the architecture (megascore's reader writes what the bridge does not:
            :func:`written_by_megascore`).
        before_write: called (if given) after that check, before the bridge writes.

    Raises:
        CheckpointError: a parameter the bridge would not write, or would write twice
            (checked before anything is written).
    """
    from megascore.checkpoint.hf_weights import load_hf_weights

    auto_bridge, why = import_auto_bridge()
    if auto_bridge is None:
        raise CheckpointError(f"{directory}: megatron-bridge does not import ({why})")
    module = _unwrap(model)
    own = written_by_megascore(module)
    bridge = auto_bridge.from_hf_pretrained(str(directory))
    # One task per parameter the bridge fills; tasks of other pipeline stages have no weight.
    tasks = bridge.get_conversion_tasks([module])
    written = [
        t.param_name
        for t in tasks
        if t is not None and t.param_weight is not None and t.param_name not in own
    ]
    source = f"{directory} (megatron-bridge)"
    check_every_parameter_written(model_tensor_names(module), [*written, *own], source)
    if before_write is not None:
        before_write()
    bridge.load_hf_weights([module])
    if own:
        load_hf_weights(model, model_cfg, directory, only=set(own))
    logger.info("loaded %s with megatron-bridge AutoBridge (%d tensors)", directory, len(written))

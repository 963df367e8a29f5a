"""Megatron ``parallel_state`` set-up for one model replica (TP x CP x PP, EP over DP x CP).

The caller owns ``torch.distributed``: it initialises the default group (gloo
on the CPU, NCCL on GPUs) before :func:`initialize_parallel` and destroys it
after :func:`destroy_parallel`. Library code takes the returned
``ProcessGroupCollection`` explicitly instead of reading ``parallel_state``.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from megascore.config import EngineConfig

logger = logging.getLogger(__name__)


def resolve_device(engine_cfg: EngineConfig) -> torch.device:
    """The device the model runs on.

    Args:
        engine_cfg: the engine config ("auto" means CUDA when available).

    Returns:
        ``cuda:<current device>`` or ``cpu``.

    Raises:
        ValueError: "cuda" was requested on a host without CUDA.
    """
    if engine_cfg.device == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if engine_cfg.device == "cuda":
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return torch.device("cpu")


def select_device(engine_cfg: EngineConfig) -> torch.device:
    """The device of this rank, resolved once at start-up: under a launcher that sets
    ``LOCAL_RANK`` a CUDA rank first makes that GPU its current device.

    Raises:
        ValueError: as :func:`resolve_device`.
    """
    device = resolve_device(engine_cfg)
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = resolve_device(engine_cfg)
    return device


def initialize_parallel(engine_cfg: EngineConfig) -> ProcessGroupCollection:
    """Creates Megatron's TP / CP / EP / DP process groups for this job.

    ``world_size`` must be a multiple of ``TP x CP x PP``; the remaining factor is
    data parallel. Expert parallelism is carved out of ``DP x CP`` as in Megatron
    (expert tensor parallel size = TP). Rank order is Megatron's default
    ``tp-cp-ep-dp-pp``: global rank 0 is on the first pipeline stage.

    Args:
        engine_cfg: parallel sizes and the collective timeout.

    Returns:
        The process-group collection (``tp``, ``cp``, ``tp_cp``, ``ep``, ``expt_tp``,
        ``dp``, ``pp`` ...) to pass to ``build_model`` and the forward.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised, or Megatron's model
            parallel state already is (call :func:`destroy_parallel` first).
        ValueError: the world size does not fit the parallel sizes.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("initialize_parallel needs an initialised torch.distributed")
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is already initialised")
    world = dist.get_world_size()
    tp = engine_cfg.tensor_model_parallel_size
    cp = engine_cfg.context_parallel_size
    ep = engine_cfg.expert_model_parallel_size
    pp = engine_cfg.pipeline_model_parallel_size
    if world % (tp * cp * pp):
        raise ValueError(
            f"world size {world} is not a multiple of TP x CP x PP = {tp} x {cp} x {pp}"
        )
    dp = world // (tp * cp * pp)
    if (dp * cp) % ep:
        raise ValueError(f"expert_model_parallel_size {ep} must divide DP x CP = {dp} x {cp}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        # Megatron only builds ``timedelta(minutes=...)`` from it: a float keeps the
        # configured seconds (rounding up to whole minutes made a 10 s timeout 60 s).
        distributed_timeout_minutes=engine_cfg.collective_timeout_s / 60,
        create_gloo_process_groups=False,
    )
    logger.info("parallel state: world=%d tp=%d cp=%d pp=%d ep=%d dp=%d", world, tp, cp, pp, ep, dp)
    return ProcessGroupCollection.use_mpu_process_groups()


def pipeline_layer_split(num_layers: int, pp: int) -> tuple[int, int] | None:
    """Decoder layers of the first and last pipeline stage when they do not divide evenly.

    Megatron gives every middle stage ``num_layers // pp`` layers when the first and
    last stage sizes are set; the remainder goes to the first and last stage (the
    first takes the larger half: the last also holds the output layer and MTP).

    Args:
        num_layers: decoder layers of the model.
        pp: pipeline stages.

    Returns:
        None for an even split, else ``(layers of the first stage, layers of the last)``
        (Megatron's ``num_layers_in_first/last_pipeline_stage``).

    Raises:
        ValueError: fewer layers than stages (naming both numbers).
    """
    if num_layers < pp:
        raise ValueError(
            f"num_layers {num_layers} < pipeline_model_parallel_size {pp}: every pipeline "
            "stage needs at least one decoder layer"
        )
    if num_layers % pp == 0:
        return None
    middle = num_layers // pp
    rest = num_layers - (pp - 2) * middle
    return (rest + 1) // 2, rest // 2


def destroy_parallel() -> None:
    """Destroys Megatron's parallel state (not the default process group)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()

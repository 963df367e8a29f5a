"""Checks of a serve configuration made before any rank starts (torch-free, well under 2 s).

A layout that does not fit the world size, a model string that names nothing,
``--device cuda`` on a host without CUDA and more ranks on a host than it shows GPUs
(CUDA's "invalid device ordinal" in a rank) would otherwise be found by every rank
after it imported torch and Megatron (seconds to a minute). Each check raises
``ValueError`` with the fix in the message (``--tp 2 needs --nproc 2 ...``); the
ranks keep their own checks for what only a built model can tell.
"""

from __future__ import annotations

import ctypes
import math
import os
from pathlib import Path

from megascore.api.errors import CheckpointError
from megascore.checkpoint.resolve import parse_model_string, read_model_config
from megascore.config import EngineConfig
from megascore.model.config import ModelConfig
from megascore_server.config import ReplicaConfig

__all__ = ["check_before_launch", "cuda_device_count", "fitting_world_size"]


def check_before_launch(config: ReplicaConfig, world_size: int, *, torchrun: bool) -> None:
    """Checks the model strings (every weight set's), the parallel layout and the device.

    Args:
        config: the resolved configuration.
        world_size: ranks of the replica (``--nproc``, or torchrun's WORLD_SIZE).
        torchrun: whether torchrun started the ranks (the fix then names its flag).

    Raises:
        ValueError: what is wrong and how to fix it.
    """
    engine = config.engine
    model = _model_config(engine.model)
    for _, other in engine.weight_set_models[1:]:  # every --weights set names something
        _model_config(other)
    _check_layout(engine, world_size, torchrun)
    if model is not None:
        _check_model_fits(engine, model)
    if engine.device in ("cuda", "auto"):
        # torchrun starts LOCAL_WORLD_SIZE of the ranks here; --nproc all of them
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if torchrun else world_size
        _check_gpus(engine.device, local, cuda_device_count(), torchrun)


def _check_gpus(device: str, local_ranks: int, gpus: int, torchrun: bool) -> None:
    """One GPU per rank: a rank's LOCAL_RANK is its device index."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    if device == "cuda" and gpus == 0:
        raise ValueError(
            f"--device cuda: no CUDA device is visible on this host{hint}; "
            "use --device cpu (or --device auto: CUDA when available)"
        )
    if gpus and local_ranks > gpus:
        flag = "--nproc-per-node" if torchrun else "--nproc"
        raise ValueError(
            f"{flag} {local_ranks} starts {local_ranks} ranks on this host but it shows "
            f"{gpus} CUDA device(s){hint}, one per rank: use {flag} {gpus} or fewer, or "
            f"--device cpu (--device {device} serves on the GPUs)"
        )


def _model_config(model: str) -> ModelConfig | None:
    """The architecture when it can be read without torch (built-ins, ``hf:``); None for
    ``megatron:`` (its directory is still checked)."""
    spec = parse_model_string(model)
    if spec.kind == "megatron":  # its reader imports torch: the file is checked, not read
        directory = Path(spec.path).expanduser()
        if not directory.is_dir():
            raise ValueError(f"model {model!r}: {spec.path} is not a directory")
        if not (directory / "megascore.json").is_file():
            raise ValueError(
                f"model {model!r}: {directory / 'megascore.json'} is missing; not a megascore "
                "Megatron checkpoint (or an incomplete save); an HF checkpoint is hf:DIR"
            )
        return None
    try:
        return read_model_config(model)
    except CheckpointError as exc:
        raise ValueError(str(exc)) from None  # names the model string and the fix


def fitting_world_size(engine: EngineConfig, at_least: int = 1) -> int:
    """The smallest world size >= ``at_least`` that the layout fits: a multiple of
    TP x CP x PP whose DP x CP is a multiple of EP."""
    unit = engine.model_parallel_size
    cp, ep = engine.context_parallel_size, engine.expert_model_parallel_size
    dp = math.ceil(at_least / unit)
    while (dp * cp) % ep:
        dp += 1
    return dp * unit


def _check_layout(engine: EngineConfig, world: int, torchrun: bool) -> None:
    tp, cp = engine.tensor_model_parallel_size, engine.context_parallel_size
    pp, ep = engine.pipeline_model_parallel_size, engine.expert_model_parallel_size
    unit = engine.model_parallel_size
    dp = world // unit
    if world % unit == 0 and (dp * cp) % ep == 0:
        return
    flags = " ".join(
        f"--{name} {size}"
        for name, size in (("tp", tp), ("cp", cp), ("pp", pp), ("ep", ep))
        if size > 1
    )
    if world % unit:
        why = f"the world size must be a multiple of TP x CP x PP = {tp} x {cp} x {pp} = {unit}"
    else:
        why = f"EP {ep} must divide DP x CP = {dp} x {cp} (DP = world size / (TP x CP x PP))"
    fit = fitting_world_size(engine)
    larger = fitting_world_size(engine, world)
    sizes = str(fit) if larger == fit else f"{fit} or {larger}"
    how = f"--nproc-per-node {sizes} to torchrun" if torchrun else f"--nproc {sizes}"
    raise ValueError(f"{flags} needs {how}: {why}, got {world} rank(s)")


def _check_model_fits(engine: EngineConfig, model: ModelConfig) -> None:
    pp, ep = engine.pipeline_model_parallel_size, engine.expert_model_parallel_size
    name = engine.model
    if pp > model.num_layers:
        raise ValueError(
            f"--pp {pp}: model {name} has {model.num_layers} decoder layers, fewer than the "
            f"pipeline stages; use --pp {model.num_layers} or less"
        )
    experts = model.num_moe_experts or 0
    if ep > 1 and not experts:
        raise ValueError(f"--ep {ep}: model {name} has no MoE layers; leave --ep at 1")
    if ep > 1 and experts % ep:
        raise ValueError(
            f"--ep {ep}: model {name} has {experts} experts per MoE layer, not a multiple "
            f"of the expert-parallel size; use an --ep that divides {experts}"
        )


def cuda_device_count() -> int:
    """CUDA devices the driver shows this process (CUDA_VISIBLE_DEVICES applies), asked of
    the driver library itself (no torch import); 0 without a driver."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value

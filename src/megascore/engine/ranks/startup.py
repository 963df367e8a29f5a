"""Setting a replica up and tearing it down, for :mod:`megascore.engine.runtime`.

The default process group (:func:`init_distributed`: its timeout at least
``load_timeout_s``, since ranks may start minutes apart), the rank that drives the
replica (``DRIVER_RANK``, rank 0) and its peer on the last pipeline stage (:func:`result_rank`),
a model load the ranks agree on before anything is written (:func:`load_agreeing`, at
start-up and on reload: :mod:`megascore.engine.weights.reload`), the replica's gloo control
groups (:func:`control_groups`) and the groups' teardown.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from megascore.api.errors import LOAD_FAILURES, WorkerLostError
from megascore.config import EngineConfig
from megascore.engine.ranks.rendezvous import init_default_group
from megascore.model.parallel import destroy_parallel

logger = logging.getLogger(__name__)

DRIVER_RANK = 0
_COMMAND_TIMEOUT = datetime.timedelta(days=365)


def init_distributed(engine_cfg: EngineConfig, device: torch.device) -> bool:
    """Initialises the default process group from the environment (torchrun / launcher).

    Returns:
        True when this call initialised it (the engine then destroys it on shutdown),
        False when the caller had (the caller keeps owning it).
    """
    if device.type == "cuda":
        # NCCL enforces a group's timeout in its watchdog thread: a collective that
        # outlives it (a peer raised, hung or died mid-step) aborts the communicators
        # and ends this process, so the launcher tears the replica down instead of
        # leaving the peers in the collective. torchrun sets this too; a bare
        # RANK / WORLD_SIZE start (Kubernetes) does not.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        # bf16 / fp16 GEMMs (the LM head in the model dtype, every torch-backend matmul)
        # accumulate in float32 like the trainer's TE GEMMs: cuBLAS may otherwise reduce
        # split-K partial sums in the half type (torch's default allows it).
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    # The default group carries the rendezvous, where ranks may arrive minutes apart
    # (imports, checkpoint reads): a short collective_timeout_s must not fail start-up.
    # Steps use the explicit groups, with the collective timeout.
    timeout = max(engine_cfg.collective_timeout_s, engine_cfg.load_timeout_s)
    init_default_group(
        backend,
        datetime.timedelta(seconds=timeout),
        # NCCL: bind this rank's GPU (its barriers would otherwise guess one)
        device if device.type == "cuda" else None,
    )
    logger.info("rank %d/%d: %s initialised", dist.get_rank(), dist.get_world_size(), backend)
    return True


def load_agreeing[Loaded](
    load: Callable[[Callable[[], None]], Loaded],
    agree: Callable[[BaseException | None], None],
    what: str,
) -> tuple[Loaded | None, BaseException | None]:
    """Every rank: ``load(before_write)`` (start-up or reload), the ranks agreeing once
    every check passed, before anything is written.

    ``agree(problem)`` is a status all-reduce that raises when any rank has a problem.
    The loader calls ``before_write`` after its checks: there this rank agrees with
    none; a rank that fails before (a bad checkpoint, a check) agrees with its error
    instead, so every rank raises at that one agreement and nothing is written anywhere.
    A load with nothing to check (a built-in at start-up) may never call it.

    Returns:
        ``(loaded, None)``; or ``(None, error)`` for a failure once writing may have begun
        (the caller's next agreement decides what follows).

    Raises:
        What ``agree`` raises.
    """
    phase = "check"  # -> "agree" (in the first agreement) -> "write" (every rank agreed)

    def before_write() -> None:
        nonlocal phase
        phase = "agree"
        agree(None)
        phase = "write"

    try:
        return load(before_write), None
    except WorkerLostError:  # an agreement itself failed
        raise
    except Exception as e:  # noqa: BLE001 - reported to every rank by the agreements
        if phase == "agree":
            raise  # the agreement found a failed rank: nothing was written
        if not isinstance(e, LOAD_FAILURES):  # a bug or an I/O surprise: its traceback
            logger.exception("rank %d: %s failed", dist.get_rank(), what)
        if phase == "check":
            agree(e)  # raises: this rank has a problem
        return None, e


def teardown_groups(groups: list[dist.ProcessGroup], destroy_default: bool) -> None:
    """Destroys Megatron's parallel state, ``groups`` and, if asked, the default group."""
    try:
        destroy_parallel()
        for group in groups:
            dist.destroy_process_group(group)
    finally:
        if destroy_default and dist.is_initialized():
            dist.destroy_process_group()


def result_rank(world_size: int, pp: int, output_rank: int = DRIVER_RANK) -> int:
    """``output_rank``'s peer on the last pipeline stage (Megatron's rank order puts PP
    outermost: stage ``s`` holds ranks ``[s * world / pp, (s + 1) * world / pp)``)."""
    return output_rank + (pp - 1) * (world_size // pp)


def check_result_rank(pg_collection) -> None:
    """The last pipeline stage of rank 0's pipeline is the rank the results come from."""
    pp = pg_collection.pp.size()
    expected = result_rank(dist.get_world_size(), pp)
    if DRIVER_RANK in dist.get_process_group_ranks(pg_collection.pp):
        last = dist.get_global_rank(pg_collection.pp, pp - 1)
        if last != expected:
            raise RuntimeError(f"last pipeline stage of rank 0 is {last}, not {expected}")


def control_groups(
    engine_cfg: EngineConfig, own_groups: list[dist.ProcessGroup]
) -> tuple[dist.ProcessGroup, dist.ProcessGroup, dist.ProcessGroup]:
    """The gloo groups over every rank for the step status, the commands and the load
    agreements (added to ``own_groups``, which the caller tears down on a failure)."""
    world = list(range(dist.get_world_size()))
    status_timeout = datetime.timedelta(seconds=3 * engine_cfg.collective_timeout_s)
    command_timeout = _COMMAND_TIMEOUT  # per process: megascore.engine.runtime
    if dist.get_rank() == DRIVER_RANK:
        command_timeout = datetime.timedelta(seconds=engine_cfg.collective_timeout_s)
    load_timeout = datetime.timedelta(seconds=engine_cfg.load_timeout_s)
    for timeout in (status_timeout, command_timeout, load_timeout):
        own_groups.append(dist.new_group(world, backend="gloo", timeout=timeout))
    return own_groups[-3], own_groups[-2], own_groups[-1]

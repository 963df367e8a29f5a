"""Process settings of a replica that serves on CUDA, made in ``megascore serve`` before
torch is imported (the ranks it starts inherit them; under torchrun each rank makes
them itself).

``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the user set the variable:
the caching allocator grows segments in place instead of keeping blocks of every size a
step of varying length asked for, so a step that fits the free memory does not fail on
fragmentation (one out-of-memory step breaks the replica). torch reads the variable
once, when CUDA is first initialised, hence before any import of torch.

``--dtype float32`` (the default) on CUDA is served as asked, with a warning at start-up
naming ``--dtype bfloat16``: float32 GEMMs run without tensor cores (TF32 stays off,
docker/Dockerfile), about 15 x fewer FLOP/s on an H100, and the Megatron trainer itself
computes in bfloat16. The default stays float32 on every device, so that a config gives
the same numbers wherever it runs.
"""

from __future__ import annotations

from collections.abc import MutableMapping

from megascore.config import EngineConfig

ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF = "expandable_segments:True"


def serves_on_cuda(engine: EngineConfig, gpus: int) -> bool:
    """Whether the replica's ranks take CUDA devices (``auto``: when the host shows any)."""
    return engine.device == "cuda" or (engine.device == "auto" and gpus > 0)


def apply_cuda_defaults(
    engine: EngineConfig, environ: MutableMapping[str, str], gpus: int
) -> list[str]:
    """Sets the allocator's configuration in ``environ`` for a CUDA replica, keeping a
    value the user set.

    Args:
        engine: the replica's engine config.
        environ: the process environment (``os.environ``).
        gpus: CUDA devices this host shows (``preflight.cuda_device_count``).

    Returns:
        Warnings for the log: float32 on CUDA.
    """
    if not serves_on_cuda(engine, gpus):
        return []
    environ.setdefault(ALLOC_CONF_ENV, ALLOC_CONF)
    if engine.dtype != "float32":
        return []
    return [
        "serving in float32 on CUDA (--dtype float32 is the default): every matmul runs "
        "without tensor cores, about 15x fewer FLOP/s than bfloat16 on an H100; "
        "--dtype bfloat16 is the faster choice and the dtype the Megatron trainer "
        "computes in (docs/deploy.md, 'One GPU')"
    ]

"""A one-rank default process group for in-process model and engine tests."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def one_rank_world(backend: str = "gloo"):
    """The default group of a one-rank world, created for the block and destroyed after
    it; a default group that already exists is used as it is."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def one_rank_parallel():
    """Megatron's parallel state of a one-rank gloo world (TP = CP = EP = 1), yielded,
    then destroyed: the body of the ``pgs`` fixtures."""
    from megascore.config import EngineConfig
    from megascore.model.parallel import destroy_parallel, initialize_parallel

    with one_rank_world():
        yield initialize_parallel(EngineConfig())
        destroy_parallel()

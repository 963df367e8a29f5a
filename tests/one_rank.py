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

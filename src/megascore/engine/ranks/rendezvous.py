"""The default process group's rendezvous: ``env://``, or a port rank 0 chose itself.

``env://`` has rank 0 bind its TCPStore to MASTER_PORT, a port someone picked in
advance; ``megascore serve --nproc N`` cannot hold one while its ranks import torch,
and another process may bind it meanwhile. So the launcher sets
``MEGASCORE_MASTER_PORT_FILE`` (:data:`megascore.config.MASTER_PORT_FILE_ENV`)
instead: rank 0 binds its store to a port of the kernel's choice and writes the port
to that file (atomically, by rename); the other ranks wait for the file and connect.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from megascore.config import MASTER_PORT_FILE_ENV

_POLL_S = 0.05


def init_default_group(
    backend: str, timeout: datetime.timedelta, device_id: torch.device | None
) -> None:
    """``dist.init_process_group`` from the environment (see the module docstring)."""
    port_file = os.environ.get(MASTER_PORT_FILE_ENV)
    if not port_file:
        dist.init_process_group(
            backend=backend, init_method="env://", timeout=timeout, device_id=device_id
        )
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if rank == 0:
        store = dist.TCPStore(
            host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        _publish(port_file, store.port)
    else:
        port = _wait_for_port(port_file, timeout)
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    os.environ["MASTER_PORT"] = str(store.port)  # as env:// would have it, for any reader
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device_id,
    )


def _publish(port_file: str, port: int) -> None:
    partial = f"{port_file}.{os.getpid()}"
    with open(partial, "w", encoding="ascii") as f:
        f.write(str(port))
    os.replace(partial, port_file)  # readers never see a half-written port


def _wait_for_port(port_file: str, timeout: datetime.timedelta) -> int:
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            with open(port_file, encoding="ascii") as f:
                return int(f.read())
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"rank 0 did not publish its store's port in {port_file} within "
                    f"{timeout.total_seconds():.0f} s"
                ) from None
        time.sleep(_POLL_S)

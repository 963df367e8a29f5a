"""The launcher's rendezvous (``megascore.engine.ranks.rendezvous``): rank 0 binds a port of the
kernel's choice and publishes it in a file; the other ranks read it and join.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap

import pytest

from megascore.config import MASTER_PORT_FILE_ENV
from megascore.engine.ranks.rendezvous import init_default_group

_RANK = textwrap.dedent(
    """
    import datetime, os, sys
    import torch, torch.distributed as dist
    from megascore.engine.ranks.rendezvous import init_default_group
    init_default_group("gloo", datetime.timedelta(seconds=60), None)
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    print("rank", dist.get_rank(), "of", dist.get_world_size(), "port",
          os.environ["MASTER_PORT"], "sum", int(total.item()), flush=True)
    dist.destroy_process_group()
    """
)


def test_ranks_meet_on_the_port_rank_0_published(tmp_path):
    port_file = tmp_path / "master_port"
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    env.update(
        {MASTER_PORT_FILE_ENV: str(port_file), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1"}
    )
    # rank 0 last: the others wait for its file
    procs = {
        rank: subprocess.Popen(
            [sys.executable, "-c", _RANK],
            env=dict(env, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (2, 1, 0)
    }
    outs = {rank: proc.communicate(timeout=120)[0] for rank, proc in procs.items()}
    assert all(proc.returncode == 0 for proc in procs.values()), outs
    port = port_file.read_text()
    for rank, out in outs.items():
        assert f"rank {rank} of 3 port {port} sum 6" in out, out


def test_a_rank_without_a_published_port_names_the_file(tmp_path, monkeypatch):
    port_file = tmp_path / "master_port"
    monkeypatch.setenv(MASTER_PORT_FILE_ENV, str(port_file))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TimeoutError, match=f"rank 0 did not publish .*{port_file}"):
        init_default_group("gloo", datetime.timedelta(seconds=0.2), None)

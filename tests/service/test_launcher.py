"""The ``--nproc`` launcher's MASTER_PORT: a free port below the ephemeral range.

A port from ``bind(0)``, released before rank 0 binds it, is what any other
process's ``bind(0)`` (or outgoing connection) may take meanwhile; a port below
the ephemeral range is not.
"""

from __future__ import annotations

import socket

import pytest

from megascore.config import EngineConfig
from megascore_server import launcher
from megascore_server.config import ReplicaConfig


class _ExitedRank:
    def __init__(self, env: dict[str, str]):
        self.env = env
        self.returncode = 0

    def poll(self) -> int:
        return 0

    def wait(self) -> int:
        return 0


def test_launcher_master_port_is_below_the_ephemeral_range(monkeypatch):
    started: list[_ExitedRank] = []

    def popen(cmd, env, preexec_fn):
        started.append(_ExitedRank(env))
        return started[-1]

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    config = ReplicaConfig(engine=EngineConfig(tensor_model_parallel_size=2), nproc=2)
    assert launcher.LocalLauncher(config).run() == 0
    ports = {int(rank.env["MASTER_PORT"]) for rank in started}
    assert len(started) == 2 and len(ports) == 1
    port = ports.pop()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    assert 20000 <= port < ephemeral_low


def test_pick_port_skips_ports_in_use(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        # Candidates: [taken, taken + 1]; taken is busy.
        monkeypatch.setattr(launcher, "ephemeral_port_low", lambda: taken + 2)
        assert launcher.pick_port(low=taken) == taken + 1
        monkeypatch.setattr(launcher, "ephemeral_port_low", lambda: taken + 1)
        with pytest.raises(RuntimeError, match="no free port"):
            launcher.pick_port(low=taken)


def test_pick_port_without_room_below_the_ephemeral_range(monkeypatch):
    monkeypatch.setattr(launcher, "ephemeral_port_low", lambda: 20000)
    with pytest.raises(RuntimeError, match="ephemeral range"):
        launcher.pick_port()


def test_ephemeral_port_low_reads_the_kernel_range():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        assert launcher.ephemeral_port_low() == int(f.read().split()[0])

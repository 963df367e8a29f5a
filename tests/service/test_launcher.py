"""The ``--nproc`` launcher's rendezvous: no MASTER_PORT picked in advance, a port file.

A port picked by the launcher and bound by rank 0 seconds later (after its imports)
may be taken by another process meanwhile; rank 0 binds a port of the kernel's choice
instead and writes it to the file every rank is told of.
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from megascore.config import MASTER_PORT_FILE_ENV, EngineConfig
from megascore_server import launcher, ports
from megascore_server.config import ReplicaConfig


class _ExitedRank:
    def __init__(self, env: dict[str, str]):
        self.env = env
        self.returncode = 0

    def poll(self) -> int:
        return 0

    def wait(self) -> int:
        return 0


def test_launcher_gives_every_rank_one_port_file_and_no_master_port(monkeypatch):
    started: list[_ExitedRank] = []

    def popen(cmd, env, preexec_fn):
        assert os.path.isdir(os.path.dirname(env[MASTER_PORT_FILE_ENV]))  # exists meanwhile
        started.append(_ExitedRank(env))
        return started[-1]

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    monkeypatch.setenv("MASTER_PORT", "29500")  # the user's own must not reach the ranks
    config = ReplicaConfig(engine=EngineConfig(tensor_model_parallel_size=2), nproc=2)
    assert launcher.LocalLauncher(config).run() == 0
    files = {rank.env[MASTER_PORT_FILE_ENV] for rank in started}
    assert len(started) == 2 and len(files) == 1
    assert all("MASTER_PORT" not in rank.env for rank in started)
    assert [rank.env["RANK"] for rank in started] == ["0", "1"]
    assert not os.path.exists(os.path.dirname(files.pop()))  # removed after the run


def _hold_a_port_before_a_free_one(held: socket.socket) -> int:
    """Binds ``held`` to a port below the ephemeral range whose next port is free, and
    returns it. Below that range the kernel hands out no port by itself, so the next one
    stays free; an ephemeral neighbour could be any connection's of the tests beside."""
    for _ in range(100):
        port = ports.pick_port()
        with socket.socket() as neighbour:
            try:
                neighbour.bind(("127.0.0.1", port + 1))
                held.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise AssertionError("no port below the ephemeral range with a free next one")


def test_pick_port_skips_ports_in_use(monkeypatch):
    with socket.socket() as held:
        taken = _hold_a_port_before_a_free_one(held)
        # Candidates: [taken, taken + 1]; taken is busy.
        monkeypatch.setattr(ports, "ephemeral_port_low", lambda: taken + 2)
        assert ports.pick_port(low=taken) == taken + 1
        monkeypatch.setattr(ports, "ephemeral_port_low", lambda: taken + 1)
        with pytest.raises(RuntimeError, match="no free port"):
            ports.pick_port(low=taken)


def test_pick_port_is_below_the_ephemeral_range():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    assert 20000 <= ports.pick_port() < ephemeral_low


def test_pick_port_without_room_below_the_ephemeral_range(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_port_low", lambda: 20000)
    with pytest.raises(RuntimeError, match="ephemeral range"):
        ports.pick_port()


def test_ephemeral_port_low_reads_the_kernel_range():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        assert ports.ephemeral_port_low() == int(f.read().split()[0])


class _FakeRank:
    """A rank that exits with ``code`` at ``exit_at`` (None: only when killed)."""

    def __init__(self, code: int, exit_at: float | None):
        self.code, self.exit_at, self.returncode, self.killed = code, exit_at, None, False

    def poll(self) -> int | None:
        due = self.exit_at is not None and time.monotonic() >= self.exit_at
        if self.returncode is None and due:
            self.returncode = self.code
        return self.returncode

    def kill(self) -> None:
        self.killed, self.returncode = True, -9

    def send_signal(self, signum: int) -> None:
        pass

    def wait(self) -> int | None:
        return self.returncode


def _run_with(monkeypatch, ranks: list[_FakeRank], **grace) -> tuple[int, float]:
    fakes = iter(ranks)
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda cmd, env, preexec_fn: next(fakes))
    config = ReplicaConfig(engine=EngineConfig(tensor_model_parallel_size=2), nproc=len(ranks))
    start = time.monotonic()
    code = launcher.LocalLauncher(config, **grace).run()
    return code, time.monotonic() - start


def test_workers_left_by_a_failed_rank_0_are_killed_after_the_orphan_grace(monkeypatch):
    now = time.monotonic()
    ranks = [_FakeRank(1, now + 0.2), _FakeRank(0, None)]  # rank 1 hung: never exits
    code, took = _run_with(monkeypatch, ranks, failure_grace_s=30.0, orphan_grace_s=0.5)
    assert code == 1 and ranks[1].killed
    assert 0.6 <= took < 5.0, took  # not the 30 s a failed worker leaves rank 0


def test_a_failed_worker_leaves_rank_0_the_failure_grace(monkeypatch):
    now = time.monotonic()
    ranks = [_FakeRank(1, now + 1.2), _FakeRank(3, now + 0.1)]  # rank 0 notices, exits 1
    code, took = _run_with(monkeypatch, ranks, failure_grace_s=30.0, orphan_grace_s=0.1)
    assert code == 3 and not ranks[0].killed and took >= 1.2

"""``megascore serve`` processes by configuration name, started ahead of their tests.

Used by the checkpoint-serving e2e modules: each test takes a ``config`` parameter
naming a server configuration; :func:`module_plan` lists those of every selected, not
skipped test of the module in run order, and :class:`ServerPool` starts servers in that
order, several at once, within a budget of live ranks, and stops each after its last test.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.e2e.serve import ServeProcess, running

START_TIMEOUT_S = 600.0  # several servers importing torch + megatron at once on 2 cores
LAYOUTS: dict[str, tuple[int, tuple[str, ...]]] = {
    "tp1": (1, ()),
    "tp2": (2, ("--tp", "2")),
    "ep2": (2, ("--ep", "2")),
    "cp2": (2, ("--cp", "2")),
    "pp2": (2, ("--pp", "2")),
}
"""The one- and two-rank layouts the parity modules serve: name -> (ranks, flags)."""


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """One server configuration: ``--model`` string, ranks, and extra flags."""

    model: str
    nproc: int = 1
    flags: tuple[str, ...] = ()


class ServerPool:
    """Servers by configuration name (a start is mostly single-threaded imports, so starts
    overlap well) with at most ``max_live_ranks`` ranks alive; :meth:`close` checks that
    every server exited 0 on SIGTERM and left no process behind.

    Args:
        log_dir: where each server's log goes (``<name>.log``).
        specs: configuration name -> :class:`ServerSpec`.
        plan: configuration names of the module's tests in run order.
        max_live_ranks: rank budget (~1 GB each).
        shared: configuration name -> a getter of the session's shared server that is that
            configuration (:class:`tests.e2e.serve.SharedServers`: same model, ranks and
            layout; only ``--grace-s`` and the metrics port differ): lent instead of a
            server of the pool's own, never started or stopped here.
    """

    def __init__(
        self,
        log_dir: Path,
        specs: dict[str, ServerSpec],
        plan: list[str],
        max_live_ranks: int = 5,
        shared: dict[str, Callable[[], ServeProcess]] | None = None,
    ):
        self.log_dir = log_dir
        self.shared = dict(shared or {})
        self.specs = {name: spec for name, spec in specs.items() if name not in self.shared}
        self.plan = [name for name in plan if name not in self.shared]
        self.max_live_ranks = max_live_ranks
        self.servers: dict[str, ServeProcess] = {}
        self.ready: set[str] = set()
        self.stopping: dict[str, concurrent.futures.Future] = {}
        self._stopper = concurrent.futures.ThreadPoolExecutor(max(1, len(specs)))

    def _start(self, name: str) -> None:
        spec = self.specs[name]
        args = ["--model", spec.model, "--grace-s", "5", *spec.flags]
        if spec.nproc > 1:
            args += ["--nproc", str(spec.nproc)]
        # MASTER_PORT=0 (what ``ensure_dist_env`` sets when it is unset, here also over one
        # the test run inherited): a single-process server's TCPStore binds a port of its
        # own choice, never one another server took first. Under --nproc the launcher drops
        # MASTER_PORT: rank 0 binds port 0 and publishes it (megascore.engine.ranks.rendezvous).
        self.servers[name] = ServeProcess(
            self.log_dir / f"{name}.log", *args, env={"MASTER_PORT": "0"}
        )

    def _start_ahead(self) -> None:
        live = sum(self.specs[n].nproc for n in self.servers if n not in self.stopping)
        for name in dict.fromkeys(self.plan):
            if name in self.servers:
                continue
            if live + self.specs[name].nproc > self.max_live_ranks:
                break
            self._start(name)
            live += self.specs[name].nproc

    def get(self, name: str) -> ServeProcess:
        if name in self.shared:
            self._start_ahead()
            return running(self.shared[name]())
        assert name not in self.stopping, f"{name} was already stopped"
        if name not in self.servers:
            self._start(name)
        self._start_ahead()
        server = self.servers[name]
        if name not in self.ready:
            server.wait_serving(timeout=START_TIMEOUT_S)
            self.ready.add(name)
        assert server.running(), f"{name} exited {server.proc.returncode}:\n{server.output()}"
        return server

    def done(self, name: str) -> None:
        """One test of ``name`` finished; the last one stops the server."""
        if name in self.shared:
            return
        if name in self.plan:
            self.plan.remove(name)
        if name not in self.plan and name in self.servers and name not in self.stopping:
            self.stopping[name] = self._stopper.submit(self._stop, self.servers[name])
            self._start_ahead()

    @staticmethod
    def _stop(server: ServeProcess) -> tuple[int | None, list[int]]:
        try:
            code = server.terminate(timeout=90) if server.running() else server.proc.returncode
            return code, server.leftovers()
        finally:
            server.close()

    def lend(self, config: str) -> Iterator[ServeProcess]:
        """Body of a test's ``server`` fixture (``yield from``): the server of ``config``,
        released after the test."""
        yield self.get(config)
        self.done(config)

    def close(self) -> None:
        for name, server in self.servers.items():
            if name not in self.stopping:
                self.stopping[name] = self._stopper.submit(self._stop, server)
        self._stopper.shutdown(wait=True)
        for name, future in self.stopping.items():
            code, left = future.result()
            assert code == 0, f"{name} exited {code}:\n{self.servers[name].output()}"
            assert not left, f"{name} left processes {left}"


def module_plan(request) -> list[str]:
    """The ``config`` of each selected, not skipped test of the requesting module, in order."""
    plan = []
    for item in request.session.items:
        if item.module is not request.module or item.get_closest_marker("skip"):
            continue
        callspec = getattr(item, "callspec", None)
        if callspec and "config" in callspec.params:
            plan.append(callspec.params["config"])
    return plan


def module_pool(
    request,
    tmp_path_factory,
    name: str,
    specs: dict[str, ServerSpec],
    shared: dict[str, str] | None = None,
):
    """Body of a module's ``pool`` fixture (``yield from``): a :class:`ServerPool` of
    ``specs`` in the module's plan, logs in a temporary ``name`` folder, closed (and
    checked) after the module. ``shared`` maps a configuration to the name of the
    session's shared server it is (``"tp1"`` -> fixture ``shared_tp1``): that server is
    lent for it (the module lists those fixtures in ``usefixtures``, so that the session
    starts them together with the other shared servers)."""
    getters = {
        config: functools.partial(request.getfixturevalue, f"shared_{server}")
        for config, server in (shared or {}).items()
    }
    servers = ServerPool(tmp_path_factory.mktemp(name), specs, module_plan(request), shared=getters)
    try:
        yield servers
    finally:
        servers.close()

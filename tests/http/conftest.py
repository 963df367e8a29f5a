"""Fixtures of the HTTP client tests: tiny transformers-saved checkpoints with a tokenizer,
their ``transformers`` references, and ``megascore serve --http-port`` servers on them.

Servers (one :class:`tests.e2e.server_pool.ServerPool` for the whole session, every
server the session's tests name started together at first use, stopped with SIGTERM at
the end, which must exit 0 and leave no process behind):

* ``llama``: the llama checkpoint on one rank (what every client test runs against);
* ``llama-tp2``, ``llama-pp2``: the same checkpoint at TP=2 and PP=2 (``--nproc 2``);
* ``moe``: a Qwen3-MoE checkpoint on one rank.

Nothing reaches a hub: ``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE`` and
``HF_DATASETS_OFFLINE`` are set for this process (lm-eval, transformers run in it) and so
for every server it starts.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from megascore_server.ports import pick_port
from tests.e2e.serve import ServeProcess
from tests.e2e.server_pool import LAYOUTS, ServerPool, ServerSpec
from tests.http.checkpoint import Reference, write_checkpoint

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
SERVERS: dict[str, tuple[str, str]] = {
    "llama": ("llama", "tp1"),
    "llama-tp2": ("llama", "tp2"),
    "llama-pp2": ("llama", "pp2"),
    "moe": ("qwen3_moe", "tp1"),
}
"""Server name -> (checkpoint family, layout of :data:`tests.e2e.server_pool.LAYOUTS`)."""
HTTP_READY_S = 120.0


@dataclasses.dataclass
class HttpServer:
    """A served checkpoint: its process (gRPC ``target``), HTTP base URL and directory."""

    name: str
    process: ServeProcess
    base_url: str
    checkpoint: Path

    @property
    def target(self) -> str:
        return self.process.target

    def get(self, path: str, status: int = 200, **kw):
        import requests

        response = requests.get(self.base_url + path, timeout=60, **kw)
        assert response.status_code == status, (path, response.status_code, response.text)
        return response.json()

    def post(self, path: str, body, status: int = 200, **kw):
        import requests

        response = requests.post(self.base_url + path, json=body, timeout=60, **kw)
        assert response.status_code == status, (path, body, response.status_code, response.text)
        return response.json()

    def model_id(self) -> str:
        return self.get("/v1/models")["data"][0]["id"]


@pytest.fixture(scope="session", autouse=True)
def offline():
    """The hub switched off for this process and every server it starts."""
    saved = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """family -> checkpoint directory (model + tokenizer), for ``llama`` and ``qwen3_moe``."""
    root = tmp_path_factory.mktemp("http-ckpt")
    return {family: write_checkpoint(family, root / family) for family in ("llama", "qwen3_moe")}


@pytest.fixture(scope="session")
def references(checkpoints) -> dict[str, Reference]:
    """family -> :class:`Reference` (transformers on the saved checkpoint)."""
    return {family: Reference(directory) for family, directory in checkpoints.items()}


def _session_plan(session) -> list[str]:
    """The servers the session's selected, not skipped tests use, in run order."""
    plan = []
    for item in session.items:
        if item.get_closest_marker("skip"):
            continue
        if {"llama", "one_rank_answers"} & set(getattr(item, "fixturenames", ())):
            plan.append("llama")
        callspec = getattr(item, "callspec", None)
        if callspec and callspec.params.get("server_name") in SERVERS:
            plan.append(callspec.params["server_name"])
    return list(dict.fromkeys(plan))


@pytest.fixture(scope="session")
def http_pool(request, tmp_path_factory, checkpoints, offline):
    """``name -> HttpServer`` getter over one :class:`ServerPool` of the session's servers."""
    specs, ports = {}, {}
    for name, (family, layout) in SERVERS.items():
        nproc, flags = LAYOUTS[layout]
        ports[name] = pick_port()
        flags = (*flags, "--http-port", str(ports[name]))
        specs[name] = ServerSpec(f"hf:{checkpoints[family]}", nproc, flags)
    plan = _session_plan(request.session)
    pool = ServerPool(tmp_path_factory.mktemp("http-servers"), specs, plan, max_live_ranks=6)
    ready: dict[str, HttpServer] = {}

    def get(name: str) -> HttpServer:
        if name not in ready:
            process = pool.get(name)
            server = HttpServer(
                name, process, f"http://127.0.0.1:{ports[name]}", checkpoints[SERVERS[name][0]]
            )
            _wait_http(server)
            ready[name] = server
        assert ready[name].process.running(), ready[name].process.output()
        return ready[name]

    try:
        yield get
    finally:
        pool.close()


def _wait_http(server: HttpServer) -> None:
    """Waits until ``GET /health`` answers 200 (the gRPC side is SERVING already)."""
    import requests

    end = time.monotonic() + HTTP_READY_S
    last = None
    while time.monotonic() < end:
        assert server.process.running(), server.process.output()
        try:
            last = requests.get(server.base_url + "/health", timeout=5)
            if last.status_code == 200:
                return
        except requests.RequestException as exc:
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"{server.name}: /health never 200 ({last}):\n{server.process.output()}")


@pytest.fixture
def llama(http_pool) -> HttpServer:
    """The one-rank server on the llama checkpoint."""
    return http_pool("llama")

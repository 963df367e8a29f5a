"""Every shell and Python block of the docs runs as written (see :mod:`tests.docs_blocks`
for the markers, options and placeholders), against served ``tiny`` / ``tiny-moe`` /
tiny ``hf:DIR`` models: one server per model for the whole module (``tiny`` and
``tiny-moe`` are the session's shared ``tp1`` and ``moe1``), started only when a
selected block needs it. The module
prints how many blocks ran and how many are marked not runnable, with the reasons.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megascore_server.ports import pick_port
from tests.docs_blocks import DEFAULT_TARGET, HF_DIR, HTTP_TARGETS, ROOT, Block, blocks
from tests.e2e.serve import ServeProcess, running

BLOCKS = blocks()
RECIPES: dict[tuple[Path, str], list[Block]] = collections.defaultdict(list)
for _block in BLOCKS:
    if _block.runnable and _block.option("recipe"):
        RECIPES[(_block.path, _block.option("recipe"))].append(_block)
SINGLE = [b for b in BLOCKS if b.runnable and not b.option("recipe")]
MARKED = [b for b in BLOCKS if not b.runnable]
RECIPE_PORT = "50051"
BLOCK_TIMEOUT_S = 300
RUNNER = """
import ast, asyncio, sys, types
path = sys.argv[1]
code = compile(open(path).read(), path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
module = types.ModuleType("__main__")
module.__file__ = path
sys.modules["__main__"] = module
result = eval(code, module.__dict__)
if asyncio.iscoroutine(result):
    asyncio.run(result)
"""
"""Runs a Python block as a script; a top-level ``await`` runs in an event loop."""
OWN_SERVERS = {
    "hf": ("--model", f"hf:{HF_DIR}"),  # the directory and --http-port filled in
}
SHARED = {"tiny": "shared_tp1", "tiny-moe": "shared_moe1"}
"""Blocks' servers that are the session's shared ones (tests.e2e.fixtures)."""
RAN: list[str] = []


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGASCORE_")}
    env["PYTHONPATH"] = os.pathsep.join(str(ROOT / p) for p in ("src", "server", "client", "."))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_block(block: Block, cwd: Path, fill: dict[str, str], timeout: float = BLOCK_TIMEOUT_S):
    """Runs ``block`` in ``cwd`` with its placeholders filled (``fill``: text -> value);
    returns the finished process (in its own session: its background jobs are the
    caller's to kill, through the returned process group id ``proc.pid``)."""
    text = block.text
    for placeholder, value in fill.items():
        text = text.replace(placeholder, value)
    if block.lang == "python":
        script = cwd / f"block_{block.line}.py"
        script.write_text(text)
        argv = [sys.executable, "-c", RUNNER, str(script)]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", text]
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), proc.pid


def _workdir(tmp_path: Path) -> Path:
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the paths the docs use
    return tmp_path


class DocServers:
    """The servers of the module's blocks by name, started together on first use."""

    def __init__(self, request, log_dir: Path):
        self.request, self.log_dir = request, log_dir
        self.own: dict[str, ServeProcess] = {}
        self.hf_dir: Path | None = None
        self.http_port: int | None = None
        mine = [item for item in request.session.items if item.module.__name__ == __name__]
        selected = {item.callspec.params.get("block") for item in mine if hasattr(item, "callspec")}
        mine_blocks = [b for b in selected if isinstance(b, Block)]
        self.wanted = {b.server for b in mine_blocks} & set(OWN_SERVERS)
        self.http = any(b.uses_http for b in mine_blocks)  # --http-port only then
        if any(item.name.startswith("test_text_") for item in mine):
            self.wanted.add("hf")

    def _start(self, name: str) -> None:
        args = list(OWN_SERVERS[name])
        if name == "hf":
            from tests.http.checkpoint import write_checkpoint

            self.hf_dir = write_checkpoint("llama", self.log_dir / "tiny-llama")
            args = ["--model", f"hf:{self.hf_dir}"]
            if self.http:
                self.http_port = pick_port()
                args += ["--http-port", str(self.http_port)]
        self.own[name] = ServeProcess(
            self.log_dir / f"{name}.log", *args, "--grace-s", "5", env={"MASTER_PORT": "0"}
        )

    def fill(self, name: str) -> dict[str, str]:
        """The placeholders of a block served by ``name``, its server SERVING."""
        if name == "none":
            return {}
        if name in SHARED:
            return {DEFAULT_TARGET: running(self.request.getfixturevalue(SHARED[name])).target}
        for other in sorted(self.wanted | {name}):
            if other not in self.own:
                self._start(other)
        server = self.own[name]
        server.wait_serving()
        fill = {DEFAULT_TARGET: running(server).target}
        if name == "hf":
            fill[HF_DIR] = str(self.hf_dir)
            if self.http_port:
                fill |= dict.fromkeys(HTTP_TARGETS, f"127.0.0.1:{self.http_port}")
        return fill

    def close(self) -> None:
        problems = []
        for name, server in self.own.items():
            try:
                code = server.terminate(timeout=60) if server.running() else server.proc.returncode
            finally:
                server.close()
            if code != 0:
                problems.append(f"{name} exited {code}:\n{server.output()}")
        assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory):
    pool = DocServers(request, tmp_path_factory.mktemp("doc-servers"))
    yield pool
    pool.close()


@pytest.fixture(scope="module", autouse=True)
def count_line(request):
    """Prints the count (ran / marked, with the reasons) after the module."""
    yield
    reasons = collections.Counter(b.not_run for b in MARKED)
    runnable = len(SINGLE) + sum(len(r) for r in RECIPES.values())
    line = (
        f"docs blocks: {len(BLOCKS)} in {len({b.path for b in BLOCKS})} docs; "
        f"{runnable} runnable ({len(RAN)} ran here), {len(MARKED)} marked not runnable"
    )
    lines = [line] + [f"  {n} x not run: {reason}" for reason, n in sorted(reasons.items())]
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        for text in ["", *lines]:
            reporter.write_line(text) if reporter else print(text)


def _ignored_by_git(paths: list[str]) -> list[str]:
    """The ``paths`` (relative to the repository root) that .gitignore does not cover."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return []
    proc = subprocess.run(
        ["git", "-C", str(ROOT), "check-ignore", "--no-index", "--stdin"],
        input="\n".join(paths) + "\n",
        capture_output=True,
        text=True,
    )
    ignored = set(proc.stdout.splitlines())
    return [p for p in paths if p not in ignored]


def _written(cwd: Path) -> list[str]:
    return sorted(
        str(p.relative_to(cwd))
        for p in cwd.rglob("*")
        if p.is_file() and "examples" not in p.relative_to(cwd).parts[:1]
        and not p.name.startswith("block_")
    )  # fmt: skip


@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", SINGLE, ids=lambda b: b.where)
def test_block_runs_as_written(block, servers, tmp_path):
    cwd = _workdir(tmp_path)
    proc, _ = run_block(block, cwd, servers.fill(block.server))
    RAN.append(block.where)
    assert proc.returncode == 0, f"{block.where}:\n{proc.stdout}\n{proc.stderr}"
    print(proc.stdout[-3000:])  # shown with -rP
    if block.path == ROOT / "README.md":  # `git status` stays clean after a README block
        assert _ignored_by_git(_written(cwd)) == [], f"{block.where}: add to .gitignore"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("recipe", list(RECIPES), ids=lambda r: f"{r[0].name}:{r[1]}")
def test_recipe_runs_in_order(recipe, tmp_path):
    cwd = _workdir(tmp_path)
    port = str(pick_port())
    sessions = []
    try:
        for block in RECIPES[recipe]:
            proc, pgid = run_block(block, cwd, {RECIPE_PORT: port})
            sessions.append(pgid)
            RAN.append(block.where)
            assert proc.returncode == 0, f"{block.where}:\n{proc.stdout}\n{proc.stderr}"
    finally:
        for pgid in sessions:  # a server the recipe started and did not stop
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_block_missing_its_import_fails(tmp_path):
    """Mutation check: the README's SDK block without its import line fails (NameError)
    before it reaches any server; with it, the same runner gets past the import."""
    (block,) = [b for b in SINGLE if b.path.name == "README.md" and b.lang == "python"][:1]
    lines = block.text.splitlines(keepends=True)
    assert any(line.startswith("from megascore_client import") for line in lines)
    mutated = Block(block.path, block.line, "python", "".join(
        line for line in lines if not line.startswith(("from ", "import "))
    ))  # fmt: skip
    proc, _ = run_block(mutated, _workdir(tmp_path), {DEFAULT_TARGET: "127.0.0.1:9"}, 60)
    assert proc.returncode != 0 and "NameError" in proc.stderr, proc.stderr


def test_a_failing_shell_line_fails_the_block(tmp_path):
    block = Block(ROOT / "README.md", 1, "shell", "echo one\nfalse\necho never\n")
    proc, _ = run_block(block, tmp_path, {})
    assert proc.returncode != 0 and "never" not in proc.stdout


def test_every_doc_block_runs_or_says_why():
    """A block is run, or carries the not-run marker with a reason; markers and options
    parse (an unknown option fails the collection)."""
    assert SINGLE and MARKED
    assert {b.path.name for b in SINGLE} >= {"README.md", "client.md", "deploy.md"}
    assert all(len(b.not_run) >= 10 for b in MARKED), [b.where for b in MARKED]
    assert sum(len(r) for r in RECIPES.values()) + len(SINGLE) + len(MARKED) == len(BLOCKS)


def test_text_rows_and_score_text_match_the_checkpoint(servers, tmp_path):
    """Against the ``hf:`` server (its own tokenizer, no ``--tokenizer``): ``megascore
    score --echo-tokens`` on text rows and the SDK's ``score_text`` give the ids and token
    strings of ``transformers``' tokenizer of the checkpoint and its logprobs (within
    1e-5), and the run says it used the server's tokenizer."""
    import json

    import numpy as np

    from megascore_client import ScoringClient
    from tests.http.checkpoint import Reference

    target = servers.fill("hf")[DEFAULT_TARGET]
    reference = Reference(servers.hf_dir)
    texts = ["the cat eats an apple at home.", "Numbers like 42, 7 and 1000 appear in text"]
    src = tmp_path / "texts.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        ["megascore", "score", str(src), "-o", str(out), "--target", target, "--echo-tokens"],
        env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"tokenizer: the server's, at {target}" in proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    with ScoringClient(target, timeout=60) as client:
        scored = client.score_text(texts, return_tokens=True)
    for i, text in enumerate(texts):
        ids = reference.tokenizer(text).input_ids  # add_special_tokens=True, as the CLI
        strings = [reference.tokenizer.decode([t]) for t in ids]
        assert rows[i]["token_ids"] == ids == scored.token_ids[i].tolist()
        assert rows[i]["tokens"] == strings == scored.tokens[i]
        want = reference.token_logprobs(ids)
        np.testing.assert_allclose(rows[i]["logprobs"][1:], want, atol=1e-5)
        np.testing.assert_allclose(scored.logprobs[i][1:], want, atol=1e-5)

"""Forked torchrun for the distributed test scripts: ranks forked from one process that
has already imported torch, Megatron-Core and the engine.

Every rank that ``torch.distributed.run`` starts imports them again (about 3 s of CPU
each, on a 2-core machine); the tests launch dozens. :func:`launch` asks the session's
zygote (``python -m tests.rank_zygote``, started on first use and ended with the
session) to run a script on N ranks. The zygote forks a *job* process, which forks the
ranks and hosts their TCPStore the way torchrun's agent does (``MASTER_ADDR`` /
``MASTER_PORT`` of its store, ``TORCHELASTIC_USE_AGENT_STORE=True``: every rank a
client). Each rank runs the script as ``__main__`` with torchrun's environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` ...), its argv, and its stdout and stderr in
one output file. As torchrun: the first rank that fails has the others terminated, and
the job's exit code is that rank's.

The zygote itself runs no torch operation and starts no thread, so forking it is safe;
under coverage.py (``patch = fork, _exit``) each forked process measures its own lines.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed",
    "megatron.core",
    "megascore.engine.runtime",
    "megascore.model.build",
    "megascore.checkpoint",
    "testkit.checkpoints",
)
"""What the zygote imports once for every rank it forks (what the scripts import)."""
TERM_GRACE_S = 5.0  # torchrun's: the ranks left after a failure, SIGTERM then SIGKILL
_PR_SET_PDEATHSIG = 1


def _run_rank(script: str, args: list[str], env: dict[str, str], out_fd: int) -> int:
    """In a forked rank: the script as ``__main__``; returns its exit code."""
    import runpy
    import traceback

    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    # line-buffered: each line one write to the shared (O_APPEND) output, never torn
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", closefd=False)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    # what an interpreter's exit runs (multiprocessing ends its pools' workers there);
    # the fork ends with os._exit, which would skip it
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _guarded(body, *args) -> int:
    """``body(*args)``'s exit code in a forked process, 1 on an exception: a fork never
    returns into the zygote's loop."""
    try:
        return body(*args)
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1


def _die_with_parent() -> None:
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _rank(req: dict, rank: int, port_pipe: int, out_fd: int) -> int:
    """In a forked rank: waits for the store's port, then runs the script."""
    _die_with_parent()
    port = os.read(port_pipe, 16).decode()
    env = dict(
        req["env"],
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(req["nproc"]),
        LOCAL_WORLD_SIZE=str(req["nproc"]),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="0",
    )
    return _run_rank(req["script"], req["args"], env, out_fd)


def _fork_ranks(req: dict, out_fd: int) -> tuple[dict[int, int], list[int]]:
    """Forks ``req["nproc"]`` ranks, each waiting for its store's port on a pipe;
    returns ``{pid: rank}`` and the pipes' write ends."""
    pids, writers = {}, []
    for rank in range(req["nproc"]):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os._exit(_guarded(_rank, req, rank, read, out_fd))
        os.close(read)
        pids[pid] = rank
        writers.append(write)
    return pids, writers


def _job(req: dict) -> int:
    """In the job process: runs the ranks to their end; returns the job's exit code."""
    import torch.distributed as dist

    os.setsid()
    _die_with_parent()
    out_fd = os.open(req["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.chdir(req["cwd"])
    pids, writers = _fork_ranks(req, out_fd)
    store = dist.TCPStore("127.0.0.1", 0, req["nproc"], is_master=True, wait_for_workers=False)
    for write in writers:
        os.write(write, str(store.port).encode())
        os.close(write)
    failed, kill_at = 0, None
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if kill_at is not None and time.monotonic() > kill_at:
                for other in pids:
                    os.kill(other, signal.SIGKILL)
            time.sleep(0.02)
            continue
        code = os.waitstatus_to_exitcode(status)
        rank = pids.pop(pid)
        if code != 0 and not failed:
            failed = code if code > 0 else 128 - code
            os.write(out_fd, f"[rank_zygote] rank {rank} exited {code}\n".encode())
            for other in pids:
                os.kill(other, signal.SIGTERM)
            kill_at = time.monotonic() + TERM_GRACE_S
    return failed


def serve() -> None:
    """The zygote: imports :data:`PRELOAD`, then runs one job per request line on stdin,
    answering ``{"pid": job}`` at once and ``{"code": exit code}`` when it ends."""
    import importlib

    _die_with_parent()  # pytest killed: no zygote (and through it no job, no rank) left
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a stray print must not reach the replies
    for stream in (sys.stdout, sys.stderr):  # a rank's lines out as they are printed
        stream.reconfigure(line_buffering=True)
    for name in PRELOAD:
        importlib.import_module(name)
    print(json.dumps({"ready": True}), file=replies, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            replies.close()
            os._exit(_guarded(_job, req))
        print(json.dumps({"pid": pid}), file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), file=replies, flush=True)


class Zygote:
    """The pytest side: the zygote process, started on first use, one job at a time."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._log = ""
        self._buffer = b""

    def _start(self, env: dict[str, str]) -> subprocess.Popen:
        log = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"rank-zygote-{os.getpid()}.log")
        with open(log, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.rank_zygote"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )
        self._log, self._buffer = log, b""
        atexit.register(self.close)
        if self._reply(proc, time.monotonic() + 300) != {"ready": True}:
            raise AssertionError(f"rank zygote did not start:\n{Path(log).read_text()[-8000:]}")
        return proc

    def _reply(self, proc: subprocess.Popen, deadline: float) -> dict | None:
        """The zygote's next reply line, or None at ``deadline``."""
        fd = proc.stdout.fileno()
        while b"\n" not in self._buffer:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise AssertionError(f"rank zygote died:\n{Path(self._log).read_text()[-8000:]}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, req: dict, env: dict[str, str], timeout: float) -> int:
        """Runs one job (``req`` as :func:`_job` reads it); returns its exit code, or
        raises :class:`subprocess.TimeoutExpired` after killing it."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start(env)
            proc = self._proc
            deadline = time.monotonic() + timeout
            proc.stdin.write(json.dumps(req).encode() + b"\n")
            proc.stdin.flush()
            job = self._reply(proc, time.monotonic() + 60)["pid"]
            reply = self._reply(proc, deadline)
            if reply is None:
                os.killpg(job, signal.SIGKILL)
                self._reply(proc, time.monotonic() + 60)
                raise subprocess.TimeoutExpired(req["script"], timeout)
            return reply["code"]

    def close(self) -> None:
        """Ends the zygote (EOF on its stdin: it exits, coverage saving its data)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


ZYGOTE = Zygote()

if __name__ == "__main__":
    serve()

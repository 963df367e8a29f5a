"""The whole test suite in pytest processes, four side by side, then one (scripts/test.sh).

Phase 1 runs four parts at once: the real-server tests (``tests/e2e``, ``tests/http``)
in two halves (:data:`E2E_FIRST`, the heavier modules by CPU time, then the rest), the
torchrun tests (``tests/distributed``) with the reliability tests that check answers and
exits, not speed or resources, and every other directory (checkpoint, unit, client,
service). Each part alone leaves a core idle much of its time (waiting on servers,
ranks, subprocesses), so four keep both cores busy; the 24 GB machine holds them.
Phase 2 runs :data:`QUIET` alone: the flood, load and soak tests compare latencies and
resources against a quiet machine, and the GPU check's tests run its rows in wall-clock
windows sized for a quiet host. A directory nobody named goes to phase 1's last part,
so no test is left out.

With a path among the arguments (``tests/unit``, ``tests/x.py::test_y``) it is one
plain pytest run. Other arguments go to every part. The first part's output is shown as
it runs, the others' once the phase ends; the status is 0 only when every part
passed. A SIGTERM here is a SIGINT to each part: pytest then stops its servers as on
Ctrl-C (SIGINT is made to interrupt again where the shell ignored it: a background job).
docs/reliability.md "The suite" has the timings.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("tests/e2e", "tests/http")
E2E_FIRST = tuple(
    f"tests/e2e/test_{name}.py"
    for name in (
        "family_serving",
        "pipeline_serving",
        "checkpoint_serving",
        "trl_example",
        "bad_weights",
        "fp8_serving",
        "data_parallel_serving",
        "adapter_replicas",
        "prefix_cache_memory",
    )
)
"""The first half of the real-server tests: about half their CPU time (docs/reliability.md)."""
RANKS = ("tests/distributed",)
QUIET = (
    *(f"tests/reliability/test_{name}.py" for name in ("flood", "load", "soak", "soak_changing")),
    "tests/unit/test_gpu_check.py",
)
"""Phase 2, alone: latencies, resources and time windows that assume a quiet machine."""


def module_files(directory: str) -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / directory).glob("test_*.py"))


def outside_quiet(directory: str) -> tuple[str, ...]:
    """``directory``, or its modules but the :data:`QUIET` ones where it holds some."""
    files = module_files(directory)
    if not any(f in QUIET for f in files):
        return (directory,)
    return tuple(f for f in files if f not in QUIET)


def label(paths: tuple[str, ...]) -> str:
    """A part's paths, the files of a folder beyond the first two as a count."""
    if len(paths) <= 3:
        return " ".join(paths)
    return f"{paths[0]} {paths[1]} and {len(paths) - 2} more"


def names_a_path(args: list[str]) -> bool:
    """Whether an argument is a file or directory of the checkout (``x.py::test_y`` too)."""
    return any(not a.startswith("-") and (ROOT / a.split("::")[0]).exists() for a in args)


def parts() -> list[list[tuple[str, ...]]]:
    """The phases, each a list of parts run side by side, each part its paths."""
    dirs = sorted(f"tests/{d.name}" for d in (ROOT / "tests").iterdir() if any(d.glob("test_*.py")))
    e2e_rest = (*(f for f in module_files("tests/e2e") if f not in E2E_FIRST), "tests/http")
    reliability = outside_quiet("tests/reliability")
    others = (d for d in dirs if d not in (*SERVERS, *RANKS, "tests/reliability"))
    rest = tuple(path for d in others for path in outside_quiet(d))
    return [[E2E_FIRST, e2e_rest, RANKS + reliability, rest], [QUIET]]


def pytest(args: list[str], dirs: tuple[str, ...], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pytest", "-q", *args, *dirs]
    with log.open("wb") as out:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def follow(log: Path, proc: subprocess.Popen) -> None:
    """Copies ``log`` to our stdout as ``proc`` writes it, until it has exited."""
    with log.open("rb") as src:
        while True:
            done = proc.poll() is not None
            chunk = src.read()
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
            elif done:
                return
            else:
                time.sleep(0.2)


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


class Stopped(Exception):
    """This runner got SIGTERM."""


def _stopped(signum, frame):
    raise Stopped


def end(procs: list[subprocess.Popen], interrupt: bool) -> None:
    """Waits for the parts still running (after SIGINT if ``interrupt``); SIGKILL at 120 s."""
    for proc in procs:
        if interrupt and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    for proc in procs:
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_phase(args: list[str], phase: list[tuple[str, ...]], log_dir: Path) -> list[tuple]:
    """Runs ``phase``'s parts side by side; (dirs, status, summary line) of each."""
    logs = [log_dir / f"part{i}.log" for i in range(len(phase))]
    procs, codes = [], None
    try:
        for i, dirs in enumerate(phase):
            print(f"suite: {label(dirs)}" + (" (shown after)" if i else ""), flush=True)
            procs.append(pytest(args, dirs, logs[i]))
        follow(logs[0], procs[0])
        codes = [proc.wait() for proc in procs]
    except Stopped:
        end(procs, interrupt=True)
    finally:
        end(procs, interrupt=False)  # on Ctrl-C the parts got SIGINT from the terminal
        texts = [log.read_text(errors="replace") for log in logs[: len(procs)]]
        for dirs, text in list(zip(phase, texts, strict=False))[1:]:
            print(f"\nsuite: output of {label(dirs)}\n{text}", end="", flush=True)
    if codes is None:
        raise SystemExit(128 + signal.SIGTERM)
    return [(d, c, last_line(t)) for d, c, t in zip(phase, codes, texts, strict=True)]


def main(args: list[str]) -> int:
    if names_a_path(args):
        return subprocess.call([sys.executable, "-m", "pytest", "-q", *args], cwd=ROOT)
    signal.signal(signal.SIGTERM, _stopped)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the parts get it by default
    start = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="megascore-suite-") as log_dir:
        try:
            for phase in parts():
                results += run_phase(args, phase, Path(log_dir))
        except KeyboardInterrupt:
            return 128 + signal.SIGINT
    print(f"\nsuite: {time.monotonic() - start:.0f} s in all")
    for dirs, code, summary in results:
        print(f"  {'ok    ' if code == 0 else 'FAILED'} {label(dirs)}: {summary}")
    return next((code for _, code, _ in results if code != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

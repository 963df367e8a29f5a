"""scripts/suite.py, the runner behind scripts/test.sh: no test directory left out, parts
side by side, the status of the part that failed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.script_module import script_module

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_module_runs_in_exactly_one_part_and_the_quiet_ones_alone():
    suite = script_module("suite")
    phases = suite.parts()

    def modules(path: str) -> list[str]:
        return [path] if (ROOT / path).is_file() else suite.module_files(path)

    named = [m for phase in phases for part in phase for path in part for m in modules(path)]
    on_disk = [str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*/test_*.py")]
    assert sorted(named) == sorted(on_disk)  # each once, none missing
    assert phases[-1] == [suite.QUIET]
    assert all((ROOT / f).is_file() for f in suite.QUIET + suite.E2E_FIRST)  # none renamed


def test_a_path_argument_makes_it_one_plain_run():
    named = script_module("suite").names_a_path
    assert named(["tests/unit"]) and named(["-x", "tests/unit/test_docs.py::test_x"])
    assert not named([]) and not named(["-p", "tests.shuffle_order", "--durations=0", "-x"])


def _runner(parts) -> list[str]:
    """A python command running the suite runner on ``parts`` instead of the real ones."""
    script = f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import suite; "
    script += f"suite.parts = lambda: {parts!r}; sys.exit(suite.main(['-p', 'no:cacheprovider']))"
    return [sys.executable, "-c", script]


def test_parts_run_side_by_side_and_the_failing_status_is_the_suites(tmp_path):
    # the first phase's two tests each wait for the other to have started
    meet = "import pathlib, time\nflags = pathlib.Path({dir!r})\n"
    meet += "def test_{me}():\n    (flags / {me!r}).touch()\n    end = time.time() + 60\n"
    meet += "    while not (flags / {other!r}).exists() and time.time() < end:\n"
    meet += "        time.sleep(0.05)\n    assert (flags / {other!r}).exists() and {ok}\n"
    cases = {"good": ("bad", True), "bad": ("good", "1 == 2"), "late": ("late", True)}
    for me, (other, ok) in cases.items():
        (tmp_path / me).mkdir()
        text = meet.format(dir=str(tmp_path), me=me, other=other, ok=ok)
        (tmp_path / me / f"test_{me}.py").write_text(text)
    parts = [[(str(tmp_path / "good"),), (str(tmp_path / "bad"),)], [(str(tmp_path / "late"),)]]
    proc = subprocess.run(_runner(parts), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr  # pytest's "tests failed"
    assert "assert (flags / 'good').exists() and 1 == 2" in out  # the second side's output
    summary = out[out.index(" s in all") :].splitlines()
    for line, (status, part, result) in zip(
        summary[1:],
        [("ok", "good", "1 passed"), ("FAILED", "bad", "1 failed"), ("ok", "late", "1 passed")],
        strict=True,
    ):
        assert line.split()[:2] == [status, f"{tmp_path / part}:"] and result in line, summary


def test_sigterm_tears_each_running_part_down_and_starts_no_other(tmp_path):
    # a test's fixture teardown is where it stops its servers: SIGTERM must let it run
    body = "import pathlib, time, pytest\nflags = pathlib.Path({dir!r})\n"
    body += "@pytest.fixture\ndef server():\n    yield\n    (flags / 'down-{me}').touch()\n"
    body += "def test_{me}(server):\n    (flags / 'up-{me}').touch()\n    time.sleep(60)\n"
    for me in ("a", "b", "c"):
        (tmp_path / me).mkdir()
        (tmp_path / me / f"test_{me}.py").write_text(body.format(dir=str(tmp_path), me=me))
    parts = [[(str(tmp_path / "a"),), (str(tmp_path / "b"),)], [(str(tmp_path / "c"),)]]
    proc = subprocess.Popen(
        _runner(parts), cwd=tmp_path, stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        end = time.monotonic() + 60
        while not all((tmp_path / f"up-{me}").exists() for me in "ab"):
            assert time.monotonic() < end and proc.poll() is None, "the parts never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0].decode()
    finally:
        with contextlib.suppress(ProcessLookupError):  # what a failing runner left behind
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert (tmp_path / "down-a").exists() and (tmp_path / "down-b").exists(), out
    assert not (tmp_path / "up-c").exists(), out
    assert f"suite: output of {tmp_path / 'b'}" in out and "KeyboardInterrupt" in out, out

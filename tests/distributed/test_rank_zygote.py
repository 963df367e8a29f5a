"""The forked torchrun of the distributed tests (:mod:`tests.rank_zygote`) against
``torch.distributed.run`` itself: the same environment, argv, output and exit codes."""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.torchrun import run_torchrun

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist


    def main():
        dist.init_process_group("gloo")
        total = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(total)
        seen = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
        report = {"argv": sys.argv[1:], "sum": total.item(), "env": seen, "name": __name__,
                  "threads": torch.get_num_threads(), "extra": os.environ.get("ZYGOTE_TEST")}
        sys.stdout.write(f"rank {dist.get_rank()} {json.dumps(report)}\\n")  # in one write
        sys.stdout.flush()
        mode = sys.argv[1]
        if mode == "fail" and dist.get_rank() == 1:
            sys.exit(3)
        if mode == "raise" and dist.get_rank() == 0:
            raise ValueError("raised on rank 0")
        if mode == "hang" and dist.get_rank() == 0:
            import time; time.sleep(600)
        if mode == "worker":  # left waiting: the interpreter's exit ends it
            import multiprocessing
            context = multiprocessing.get_context("spawn")
            queue = context.Queue()
            worker = context.Process(target=queue.get, daemon=True)
            worker.start()
            print("worker", worker.pid, flush=True)
        dist.destroy_process_group()


    if __name__ == "__main__":  # not in a spawned pool worker
        main()
    """
)


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("zygote") / "ranks.py"
    path.write_text(_SCRIPT)
    return path


def _reports(output: str) -> dict[int, dict]:
    lines = [line.split(" ", 2) for line in output.splitlines() if line.startswith("rank ")]
    return {int(rank): json.loads(report) for _, rank, report in lines}


def test_forked_ranks_see_what_torchrun_ranks_see(script, monkeypatch):
    monkeypatch.setenv("ZYGOTE_TEST", "from the test")
    forked = _reports(run_torchrun(script, 3, "ok", "x"))
    real = _reports(run_torchrun(script, 3, "ok", "x", forked=False))
    assert forked == real
    assert sorted(forked) == [0, 1, 2]
    assert forked[2] == {
        "argv": ["ok", "x"],
        "sum": 6.0,
        "env": {"RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"},
        "name": "__main__",
        "threads": 1,
        "extra": "from the test",
    }


@pytest.mark.parametrize(
    ("mode", "message"), [("fail", "rank 1 exited 3"), ("raise", "ValueError: raised on rank 0")]
)
def test_a_failed_rank_fails_the_launch_with_its_output(script, mode, message):
    with pytest.raises(AssertionError, match="exited") as failure:
        run_torchrun(script, 2, mode)
    assert message in str(failure.value)


def test_a_hung_launch_is_killed_at_its_timeout_and_the_next_runs(script):
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_torchrun(script, 2, "hang", timeout=5)
    assert time.monotonic() - start < 30
    assert sorted(_reports(run_torchrun(script, 2, "ok"))) == [0, 1]


def test_a_worker_a_rank_leaves_waiting_is_ended_with_it(script):
    """As at an interpreter's exit (the forked rank ends with ``os._exit``): a daemonic
    ``multiprocessing`` worker does not outlive its rank (the ranks of
    ``checkpoint/test_parallel_load.py`` left two such workers each before)."""
    output = run_torchrun(script, 2, "worker")
    workers = [int(line.split()[1]) for line in output.splitlines() if line.startswith("worker")]
    assert len(workers) == 2
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), pid


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True

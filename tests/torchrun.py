"""Runs a script on N gloo ranks on the CPU from pytest: forked from the session's
zygote (:mod:`tests.rank_zygote`), or under ``torch.distributed.run`` itself.

Scripts write their results (numpy ``.npz`` / JSON) into an output directory the
test then compares; a failure anywhere fails the test with the ranks' output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.rank_zygote import ZYGOTE

ROOT = Path(__file__).resolve().parents[1]


def run_torchrun(
    script: Path | str, nproc: int, *args: str, timeout: float = 300, forked: bool = True
) -> str:
    """Runs ``script`` on ``nproc`` local ranks; returns combined output, raises on failure.

    ``forked``: the ranks are forked from the session's zygote, which has imported torch,
    Megatron-Core and the engine once (:mod:`tests.rank_zygote`); otherwise each is a
    fresh interpreter under ``torch.distributed.run`` itself.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    # the scripts may import the shared test helpers (``tests.*``)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if forked:
        return _run_forked(Path(script), nproc, list(args), env, timeout)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--standalone",  # its store binds a port of the kernel's choice: none to collide
        "--max-restarts=0",
        str(script),
        *args,
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, start_new_session=True
    )
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}:\n{out[-8000:]}")
    return out


def _run_forked(script: Path, nproc: int, args: list[str], env: dict, timeout: float) -> str:
    with tempfile.NamedTemporaryFile("r", prefix="ranks-", suffix=".log") as output:
        request = {
            "script": str(script.resolve()),
            "nproc": nproc,
            "args": args,
            "env": env,
            "cwd": os.getcwd(),
            "output": output.name,
        }
        code = ZYGOTE.run(request, env, timeout)
        out = output.read()
    if code != 0:
        raise AssertionError(f"forked torchrun exited {code}:\n{out[-8000:]}")
    return out


def run_check_script(
    script: Path | str, nproc: int, out_dir: Path, results: str, *args: str, timeout: float = 600
) -> dict:
    """Runs a script that records named checks per rank (``engine_common.CheckLog``) into
    ``out_dir / f"{results}{rank}.json"`` (its first argument is ``out_dir``).

    Returns:
        ``{"error": the launch's failure output or None, "checks": {rank: {name: outcome}}}``.
    """
    try:
        run_torchrun(script, nproc, str(out_dir), *args, timeout=timeout)
        error = None
    except AssertionError as e:
        error = str(e)
    checks = {}
    for rank in range(nproc):
        path = out_dir / f"{results}{rank}.json"
        checks[rank] = json.loads(path.read_text()) if path.exists() else {}
    return {"error": error, "checks": checks}

"""The one-shot GPU check of megascore (run through ``scripts/gpu_check.sh``).

Prints one markdown table, ``| check | result | seconds | detail |`` with result
PASS / FAIL / SKIP / INFO, then ``gpu_check: N pass, N fail, N skip`` and exits
non-zero when a check failed. Rows, each bounded in time (about 5 minutes on one
H200; 10 at most):

* versions: Python, torch / CUDA / GPU, megatron-core, TransformerEngine,
  megatron-bridge, transformers, ``HAVE_TE``, ``HAVE_BRIDGE``;
* ``tests/gpu``, one row per test (the CUDA engine test of tiny and tiny-moe in
  bfloat16 with top-k, losses, temperature, mask and metrics, each backend; TE vs
  torch where TE imports);
* ``megascore serve --device cuda`` end to end with the CLI (health, info, score);
* HF tiny Llama and Mixtral -> ``scripts/convert_hf_to_megatron.py`` (torchrun) ->
  ``megatron:`` served by the engine with each backend (float32 and bfloat16), and
  ``hf:`` directly (float32 torch; bfloat16 TE: megatron-bridge where it applies), vs
  transformers (float32: max difference; bfloat16: mean difference against
  transformers' own bfloat16 deviation, since bf16 rounding flips MoE routing);
* ``bench/mfu.py --device cuda``.

Without CUDA every GPU row is ``SKIP`` with "no CUDA" and the script exits 0.
``--device cpu`` runs the same rows on the CPU instead (float32 / bfloat16, torch
backend): a dry run of the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
CLI = [PY, "-m", "megascore_client.cli"]
NO_CUDA = "no CUDA"
FAMILIES = ("llama", "mixtral")
FP32_TOL = 1e-3  # max |logprob diff|: float32 on the GPU (no TF32) vs transformers in float32
# bfloat16 rounding can flip a MoE routing choice (transformers' own bf16 Mixtral moves
# single logprobs by nats), so bf16 rows compare *mean* deviations from transformers
# in float32: at most BF16_FACTOR x transformers' own bf16 deviation (or BF16_FLOOR).
BF16_FACTOR, BF16_FLOOR = 3.0, 0.02
GPU_ROWS = (
    "tests/gpu",
    "serve --device cuda (CLI)",
    "checkpoint round trip",
    "bench/mfu.py --device cuda",
)


class Table:
    """The rows printed at the end (and as they come, on stderr)."""

    def __init__(self):
        self.rows: list[tuple[str, str, float, str]] = []

    def add(self, check: str, result: str, seconds: float = 0.0, detail: str = "") -> None:
        detail = " ".join(str(detail).split())[:160].replace("|", "/")
        self.rows.append((check, result, seconds, detail))
        print(f"gpu_check: {check}: {result} {detail}", file=sys.stderr, flush=True)

    def run(self, check: str, fn, *args) -> None:
        start = time.monotonic()
        try:
            result, detail = fn(*args)
        except Exception as e:  # noqa: BLE001 - a failing check is a row, not the end
            result, detail = "FAIL", f"{type(e).__name__}: {e}"
        self.add(check, result, time.monotonic() - start, detail)

    def print(self) -> int:
        print("| check | result | seconds | detail |")
        print("|---|---|---|---|")
        for check, result, seconds, detail in self.rows:
            print(f"| {check} | {result} | {seconds:.1f} | {detail} |")
        counts = {r: sum(1 for row in self.rows if row[1] == r) for r in ("PASS", "FAIL", "SKIP")}
        print(f"gpu_check: {counts['PASS']} pass, {counts['FAIL']} fail, {counts['SKIP']} skip")
        return 1 if counts["FAIL"] else 0


def _run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}: {' / '.join(tail)}")
    return proc


def _version(module: str) -> str:
    try:
        mod = __import__(module, fromlist=["__version__"])
    except Exception as e:  # noqa: BLE001 - TE / the bridge fail in many ways without CUDA
        return f"absent ({type(e).__name__})"
    return str(getattr(mod, "__version__", "?"))


def versions(table: Table) -> bool:
    """INFO rows; returns whether CUDA is available."""
    import torch

    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name(0) if cuda else NO_CUDA
    table.add("python", "INFO", detail=sys.version.split()[0])
    table.add("torch", "INFO", detail=f"{torch.__version__} (CUDA {torch.version.cuda}) {gpu}")
    for name, module in (
        ("megatron-core", "megatron.core"),
        ("transformer-engine", "transformer_engine"),
        ("transformers", "transformers"),
    ):
        table.add(name, "INFO", detail=_version(module))
    from megascore.checkpoint.hf_bridge import have_bridge, import_auto_bridge
    from megascore.model.build import HAVE_TE

    why = import_auto_bridge()[1]
    bridge = f"absent ({why})" if why else _version("megatron.bridge.package_info")
    table.add("megatron-bridge", "INFO", detail=bridge)
    table.add("HAVE_TE", "INFO", detail=str(HAVE_TE))
    table.add("HAVE_BRIDGE", "INFO", detail=str(have_bridge()))
    return cuda


def gpu_tests(table: Table, out: Path) -> None:
    """tests/gpu under pytest: one row per test case."""
    xml = out / "gpu_tests.xml"
    start = time.monotonic()
    cmd = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu", f"--junitxml={xml}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    if not xml.exists():
        tail = " / ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
        table.add("tests/gpu", "FAIL", time.monotonic() - start, f"exit {proc.returncode}: {tail}")
        return
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"tests/gpu::{case.get('name')}"
        seconds = float(case.get("time", 0))
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            table.add(name, "FAIL", seconds, failure.get("message", ""))
        elif skipped is not None:
            table.add(name, "SKIP", seconds, skipped.get("message", ""))
        else:
            table.add(name, "PASS", seconds)


def _free_port() -> int:
    from megascore_server.launcher import pick_port

    return pick_port()


def serve_e2e(device: str, dtype: str, out: Path) -> tuple[str, str]:
    """``megascore serve`` subprocess, then health / info / score with the CLI, then SIGTERM."""
    port = _free_port()
    target = f"127.0.0.1:{port}"
    cmd = [*CLI, "serve", "--model", "tiny", "--device", device, "--dtype", dtype]
    cmd += ["--port", str(port), "--log-level", "WARNING"]
    log = open(out / "serve.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _run([*CLI, "health", "--target", target, "--wait", "240"], timeout=260)
        info = json.loads(_run([*CLI, "info", "--target", target], timeout=60).stdout)
        scored = out / "smoke.scored.jsonl"
        smoke = str(ROOT / "examples" / "smoke.jsonl")
        score = [*CLI, "score", "--target", target, smoke, "-o", str(scored)]
        _run([*score, "--top-k", "2", "--no-progress"], timeout=120)
        rows = [json.loads(line) for line in scored.read_text().splitlines()]
        want = len((ROOT / "examples" / "smoke.jsonl").read_text().splitlines())
        if len(rows) != want:
            return "FAIL", f"{len(rows)} scored lines for {want} inputs"
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=90)
        if code != 0:
            return "FAIL", f"server exited {code} after SIGTERM"
        backend = info.get("attention_backend", info.get("attentionBackend", "?"))
        return "PASS", f"{len(rows)} lines scored; dtype {dtype}, backend {backend}; exit 0"
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def _engine_logprobs(model: str, device: str, dtype: str, backend: str, ids) -> tuple:
    """Logprobs ``[b, s-1]`` of ``ids`` from a world-size-1 engine, and its backend."""
    import numpy as np

    from megascore.config import EngineConfig
    from megascore.engine.runtime import DistributedEngine
    from megascore.types import ScoreBatch

    cfg = EngineConfig(model=model, device=device, dtype=dtype, attention_backend=backend)
    engine = DistributedEngine.create(cfg)
    try:
        b, s = ids.shape
        batch = ScoreBatch(token_ids=ids.reshape(-1).numpy(), lengths=np.full(b, s))
        out = engine.score(batch)
        used = engine.info().attention_backend
    finally:
        engine.shutdown()
    return out.logprobs.reshape(b, s)[:, 1:].astype(np.float64), used


def round_trip_worker(out: Path, device: str) -> None:
    """Subprocess body of the round trip: prints one JSON row per line."""
    import numpy as np

    from megascore.model.build import HAVE_TE
    from tests.checkpoint.scripts.ckpt_common import (
        hf_logprobs,
        make_hf_model,
        token_batch,
        write_hf_checkpoint,
    )

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0")
    os.environ.update(WORLD_SIZE="1", LOCAL_RANK="0")
    backends = ["torch", "te"] if HAVE_TE and device == "cuda" else ["torch"]
    ids = token_batch()
    for family in FAMILIES:
        hf, mg = out / f"hf_{family}", out / f"megatron_{family}"
        start = time.monotonic()
        ref = write_hf_checkpoint(family, hf)
        import torch

        hf_bf16 = hf_logprobs(make_hf_model(family).to(torch.bfloat16), ids)
        bf16_tol = max(BF16_FACTOR * float(np.abs(hf_bf16 - ref).mean()), BF16_FLOOR)
        convert = [PY, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port"]
        convert += [str(_free_port()), str(ROOT / "scripts" / "convert_hf_to_megatron.py")]
        convert += ["--hf", str(hf), "--out", str(mg), "--device", device, "--dtype", "float32"]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        _run(convert, timeout=240, env=env)
        _row(f"convert {family}", "PASS", time.monotonic() - start, "HF -> megatron: (torchrun)")
        cases = [("megatron", "float32", "torch"), ("hf", "float32", "torch")]
        cases += [("megatron", "bfloat16", b) for b in backends]
        if "te" in backends:
            cases.append(("hf", "bfloat16", "te"))  # megatron-bridge where it applies
        for kind, dtype, backend in cases:
            start = time.monotonic()
            name = f"{kind}:{family} {dtype} {backend}"
            try:
                path = mg if kind == "megatron" else hf
                got, used = _engine_logprobs(f"{kind}:{path}", device, dtype, backend, ids)
                dev = np.abs(got - ref)
                if dtype == "float32":
                    diff, tol, what = float(dev.max()), FP32_TOL, "max"
                else:
                    diff, tol, what = float(dev.mean()), bf16_tol, "mean"
                result = "PASS" if diff <= tol and used == backend else "FAIL"
                detail = (
                    f"{what} abs logprob diff vs transformers fp32 {diff:.2e} (tol {tol:.2e}; "
                    f"max {dev.max():.2e}); backend {used}"
                )
            except Exception as e:  # noqa: BLE001 - a row per case
                result, detail = "FAIL", f"{type(e).__name__}: {e}"
            _row(name, result, time.monotonic() - start, detail)


def _row(check: str, result: str, seconds: float, detail: str) -> None:
    print(json.dumps({"row": [check, result, seconds, detail]}), flush=True)


def round_trip(table: Table, device: str, out: Path) -> None:
    start = time.monotonic()
    cmd = [PY, __file__, "--round-trip-worker", "--device", device, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, cwd=ROOT)
    rows = [json.loads(line)["row"] for line in proc.stdout.splitlines() if line.startswith("{")]
    for check, result, seconds, detail in rows:
        table.add(f"round trip: {check}", result, seconds, detail)
    if proc.returncode != 0 or not rows:
        tail = " / ".join(proc.stderr.strip().splitlines()[-3:])
        table.add("checkpoint round trip", "FAIL", time.monotonic() - start, tail)


def mfu(device: str) -> tuple[str, str]:
    cmd = [PY, str(ROOT / "bench" / "mfu.py"), "--device", device]
    if device == "cpu":
        cmd += ["--num-sequences", "4", "--max-tokens", "1024"]
    proc = _run(cmd, timeout=240, cwd=ROOT / "bench")
    ratios = [line.rsplit("->", 1)[1].strip() for line in proc.stdout.splitlines() if "->" in line]
    return ("PASS" if ratios else "FAIL"), f"model FLOP/s over torch.mm: {', '.join(ratios)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--out", help="directory for logs and checkpoints (default: a temp dir)")
    parser.add_argument("--round-trip-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    if args.round_trip_worker:
        round_trip_worker(out, args.device)
        return 0
    table = Table()
    cuda = versions(table)
    device = "cpu" if args.device == "cpu" else "cuda"
    if device == "cuda" and not cuda:
        for row in GPU_ROWS:
            table.add(row, "SKIP", detail=NO_CUDA)
        return table.print()
    dtype = "bfloat16" if device == "cuda" else "float32"
    gpu_tests(table, out)
    table.run(f"serve --device {device} (CLI)", serve_e2e, device, dtype, out)
    round_trip(table, device, out / "round_trip")
    table.run(f"bench/mfu.py --device {device}", mfu, device)
    return table.print()


if __name__ == "__main__":
    sys.exit(main())

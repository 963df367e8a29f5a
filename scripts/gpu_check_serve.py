"""The extra rows of ``scripts/gpu_check.py`` (``--rows tests-gpu,serve,serve-cpu,sdk,round-trip``
or ``--rows all``): the served paths, end to end.

* ``tests/gpu``, one row per test (the CUDA engine in bfloat16 against the float32
  forward, tiny and tiny-moe, each backend; TE vs torch where TE imports);
* ``megascore serve`` end to end with the CLI (health, info, score, SIGTERM), on the
  device and with ``--device cpu`` on the CUDA host;
* through the SDK on a served tiny HF Mixtral: MoE routing recorded and replayed, and a
  bfloat16 weight push (then equal to transformers on the pushed weights);
* HF Llama and Mixtral -> ``scripts/convert_hf_to_megatron.py`` -> ``megatron:`` and
  ``hf:`` served with each backend, against transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
CLI = [PY, "-m", "megascore_client.cli"]
FAMILIES = ("llama", "mixtral")
FP32_TOL = 1e-3  # max |logprob diff|: float32 on the GPU (no TF32) vs transformers in float32
# bfloat16 rounding can flip a MoE routing choice (transformers' own bf16 Mixtral moves
# single logprobs by nats), so bf16 rows compare *mean* deviations from transformers
# in float32: at most BF16_FACTOR x transformers' own bf16 deviation (or BF16_FLOOR).
BF16_FACTOR, BF16_FLOOR = 3.0, 0.02


def _run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}: {' / '.join(tail)}")
    return proc


def gpu_tests(ctx) -> None:
    """tests/gpu under pytest: one row per test case."""
    xml = ctx.out / "gpu_tests.xml"
    start = time.monotonic()
    cmd = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu", f"--junitxml={xml}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ctx.seconds, cwd=ROOT)
    if not xml.exists():
        tail = " / ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
        ctx.emit("tests/gpu", "FAIL", time.monotonic() - start, f"exit {proc.returncode}: {tail}")
        return
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"tests/gpu::{case.get('name')}"
        seconds = float(case.get("time", 0))
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if failure is not None:
            ctx.emit(name, "FAIL", seconds, failure.get("message", ""))
        elif case.find("skipped") is not None:
            ctx.emit(name, "SKIP", seconds, case.find("skipped").get("message", ""))
        else:
            ctx.emit(name, "PASS", seconds, "")


class Served:
    """``megascore serve`` in a subprocess (a ``ServeProcess``) on a free port."""

    def __init__(self, model: str, device: str, dtype: str, log: Path, *extra: str):
        from megascore_server.serve_process import ServeProcess

        flags = ["--model", model, "--device", device, "--dtype", dtype]
        self.started = time.monotonic()
        self.server = ServeProcess(log, *flags, "--log-level", "WARNING", *extra)
        self.target = self.server.target

    def wait_healthy(self, timeout: float = 240) -> float:
        """Seconds from start to SERVING, as the CLI's ``health --wait`` sees it."""
        _run([*CLI, "health", "--target", self.target, "--wait", str(timeout)], timeout + 20)
        return time.monotonic() - self.started

    def stop(self) -> int:
        """SIGTERM, then the exit status (SIGKILL of what is left after 90 s)."""
        return self.server.stop(grace=90)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.server.close()


def serve_e2e(device: str, dtype: str, out: Path, seconds: float) -> tuple[str, str]:
    """``megascore serve`` subprocess, then health / info / score with the CLI, then SIGTERM."""
    with Served("tiny", device, dtype, out / f"serve_{device}.log") as server:
        server.wait_healthy(timeout=seconds)
        target = server.target
        info = json.loads(_run([*CLI, "info", "--target", target], timeout=60).stdout)
        scored = out / f"smoke_{device}.scored.jsonl"
        smoke = str(ROOT / "examples" / "smoke.jsonl")
        score = [*CLI, "score", "--target", target, smoke, "-o", str(scored)]
        _run([*score, "--top-k", "2", "--no-progress"], timeout=120)
        rows = [json.loads(line) for line in scored.read_text().splitlines()]
        want = len((ROOT / "examples" / "smoke.jsonl").read_text().splitlines())
        if len(rows) != want:
            return "FAIL", f"{len(rows)} scored lines for {want} inputs"
        code = server.stop()
        if code != 0:
            return "FAIL", f"server exited {code} after SIGTERM"
        backend = info.get("attention_backend", info.get("attentionBackend", "?"))
        return "PASS", f"{len(rows)} lines scored; dtype {dtype}, backend {backend}; exit 0"


def serve_cli(ctx) -> tuple[str, str]:
    return serve_e2e(ctx.device, ctx.dtype, ctx.out, ctx.seconds)


def serve_cpu(ctx) -> tuple[str, str]:
    if ctx.device != "cuda":
        return "SKIP", "the CPU server beside CUDA: only on a CUDA host"
    return serve_e2e("cpu", "float32", ctx.out, ctx.seconds)


def _max_diff(a: list, b: list) -> float:
    import numpy as np

    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def _routing_replay(client, seqs) -> tuple[str, str]:
    recorded = client.score(seqs, return_routing=True)
    replayed = client.score(seqs, routing=recorded.routing)
    same = _max_diff(recorded.logprobs, replayed.logprobs)
    experts = 1 + max(int(r.max()) for r in recorded.routing)
    moved = [(r + 1) % experts for r in recorded.routing]  # every token to other experts
    changed = client.score(seqs, routing=moved)
    diff = _max_diff(recorded.logprobs, changed.logprobs)
    ok = same <= 1e-5 and diff > 1e-3
    shape = "x".join(map(str, recorded.routing[0].shape))
    detail = f"routing [{shape}] per sequence; replay vs record {same:.1e}; moved {diff:.2f}"
    return ("PASS" if ok else "FAIL"), detail


def _bf16_push(client, seqs, ids, dtype: str) -> tuple[str, str]:
    """New weights (another seed) rounded to bfloat16, pushed as bfloat16; the reference
    is transformers in float32 on the rounded weights (buffers such as RoPE's
    frequencies stay float32, as in the server)."""
    import numpy as np
    import torch

    from testkit.checkpoints import hf_logprobs, make_hf_model

    new = make_hf_model("mixtral", seed=1)
    with torch.no_grad():
        for param in new.parameters():
            param.copy_(param.to(torch.bfloat16))
    bf16 = ((k, v.to(torch.bfloat16)) for k, v in new.state_dict().items())
    pushed = client.push_weights(bf16, weights_version="bf16-push")
    got = client.score(seqs)
    lp = np.stack([np.asarray(x[1:], dtype=np.float64) for x in got.logprobs])
    dev = np.abs(lp - hf_logprobs(new, ids))
    diff, tol = (dev.max(), FP32_TOL) if dtype == "float32" else (dev.mean(), BF16_FLOOR)
    ok = diff <= tol and got.weights_version == "bf16-push"
    detail = (
        f"{pushed.num_bytes / 2**20:.1f} MiB bf16 in {pushed.seconds:.2f} s; version "
        f"{got.weights_version}; logprobs vs transformers on the pushed weights "
        f"{diff:.2e} (tol {tol:.0e})"
    )
    return ("PASS" if ok else "FAIL"), detail


def sdk_rows(ctx) -> None:
    """Routing record -> replay and a bf16 push, through the SDK on a served HF Mixtral."""
    from megascore_client import ScoringClient
    from testkit.checkpoints import token_batch, write_hf_checkpoint

    hf = ctx.out / "hf_mixtral_sdk"
    write_hf_checkpoint("mixtral", hf)
    ids = token_batch()
    seqs = ids.tolist()
    server = Served(f"hf:{hf}", ctx.device, ctx.dtype, ctx.out / "serve_sdk.log")
    with server, ScoringClient(server.target, timeout=120) as client:
        server.wait_healthy(timeout=ctx.seconds)
        for name, fn, args in (
            ("routing record -> replay (SDK)", _routing_replay, (client, seqs)),
            ("bf16 push (SDK)", _bf16_push, (client, seqs, ids, ctx.dtype)),
        ):
            start = time.monotonic()
            try:
                result, detail = fn(*args)
            except Exception as e:  # noqa: BLE001 - a row per case
                result, detail = "FAIL", f"{type(e).__name__}: {e}"
            ctx.emit(name, result, time.monotonic() - start, detail)
        if server.stop() != 0:
            ctx.emit("serve (SDK rows)", "FAIL", 0.0, "server exit non-zero after SIGTERM")


def engine_logprobs(model: str, device: str, dtype: str, ids, **options) -> tuple:
    """Logprobs ``[b, s-1]`` of ``ids`` from a world-size-1 engine, and its backend."""
    import numpy as np

    from megascore.api.types import ScoreBatch
    from megascore.config import EngineConfig
    from megascore.engine.runtime import DistributedEngine

    cfg = EngineConfig(model=model, device=device, dtype=dtype, **options)
    engine = DistributedEngine.create(cfg)
    try:
        b, s = ids.shape
        out = engine.score(ScoreBatch(token_ids=ids.reshape(-1).numpy(), lengths=np.full(b, s)))
        used = engine.info().attention_backend
    finally:
        engine.shutdown()
    return out.logprobs.reshape(b, s)[:, 1:].astype(np.float64), used


def bf16_tolerance(hf_model, ids, ref) -> float:
    """The bf16 rows' mean tolerance: ``BF16_FACTOR`` x transformers' own bf16 deviation."""
    import numpy as np
    import torch

    from testkit.checkpoints import hf_logprobs

    hf_bf16 = hf_logprobs(hf_model.to(torch.bfloat16), ids)
    hf_model.to(torch.float32)
    return max(BF16_FACTOR * float(np.abs(hf_bf16 - ref).mean()), BF16_FLOOR)


def compare(got, ref, dtype: str, bf16_tol: float) -> tuple[bool, str]:
    """fp32: max deviation within ``FP32_TOL``; bf16: mean deviation within ``bf16_tol``."""
    import numpy as np

    dev = np.abs(got - ref)
    if dtype == "float32":
        diff, tol, what = float(dev.max()), FP32_TOL, "max"
    else:
        diff, tol, what = float(dev.mean()), bf16_tol, "mean"
    detail = f"{what} |logprob - transformers fp32| {diff:.2e} (tol {tol:.2e}; max {dev.max():.2e})"
    return diff <= tol, detail


def round_trip(ctx) -> None:
    """HF -> convert_hf_to_megatron.py -> ``megatron:`` and ``hf:`` vs transformers."""
    from megascore.model.build import HAVE_TE
    from megascore_server.ports import pick_port
    from testkit.checkpoints import make_hf_model, token_batch, write_hf_checkpoint

    sys.path.insert(0, str(ROOT / "bench"))
    import common

    common.single_rank_env()
    backends = ["torch", "te"] if HAVE_TE and ctx.device == "cuda" else ["torch"]
    ids = token_batch()
    for family in FAMILIES:
        hf, mg = ctx.out / f"hf_{family}", ctx.out / f"megatron_{family}"
        start = time.monotonic()
        ref = write_hf_checkpoint(family, hf)
        bf16_tol = bf16_tolerance(make_hf_model(family), ids, ref)
        convert = [PY, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port"]
        convert += [str(pick_port()), str(ROOT / "scripts" / "convert_hf_to_megatron.py")]
        convert += ["--hf", str(hf), "--out", str(mg), "--device", ctx.device]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        _run([*convert, "--dtype", "float32"], timeout=240, env=env)
        ctx.emit(
            f"convert {family}", "PASS", time.monotonic() - start, "HF -> megatron: (torchrun)"
        )
        cases = [("megatron", "float32", "torch"), ("hf", "float32", "torch")]
        cases += [("megatron", "bfloat16", b) for b in backends]
        if "te" in backends:
            cases.append(("hf", "bfloat16", "te"))  # megatron-bridge where it applies
        for kind, dtype, backend in cases:
            start = time.monotonic()
            try:
                path = mg if kind == "megatron" else hf
                got, used = engine_logprobs(
                    f"{kind}:{path}", ctx.device, dtype, ids, attention_backend=backend
                )
                ok, detail = compare(got, ref, dtype, bf16_tol)
                result = "PASS" if ok and used == backend else "FAIL"
                detail += f"; backend {used}"
            except Exception as e:  # noqa: BLE001 - a row per case
                result, detail = "FAIL", f"{type(e).__name__}: {e}"
            ctx.emit(f"{kind}:{family} {dtype} {backend}", result, time.monotonic() - start, detail)

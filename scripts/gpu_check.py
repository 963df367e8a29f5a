"""The one-shot GPU check of megascore (run through ``scripts/gpu_check.sh``).

Prints one markdown table, ``| check | result | seconds | detail |`` with result
PASS / FAIL / SKIP / WARN / INFO, then ``gpu_check: N pass, N fail, N skip, N warn``
and exits non-zero when a check failed. Rows, each bounded in time, at most 8 minutes
in all on one GPU (a row that would start later is SKIP "time budget"):

* versions: Python, torch / CUDA / GPU, megatron-core, TransformerEngine,
  megatron-bridge, transformers, ``HAVE_TE``, ``HAVE_BRIDGE``; a WARN row when
  TransformerEngine is absent (its rows then do not run: the torch backend is checked);
* ``tests/gpu``, one row per test: the CUDA engine in bfloat16 against the float32
  forward (tiny and tiny-moe, top-k, losses, temperature, mask and metrics, each
  backend; TE vs torch where TE imports);
* ``megascore serve --device cuda`` end to end with the CLI (health, info, score,
  SIGTERM), and ``--device cpu`` on the same host;
* through the SDK, on a served tiny HF Mixtral: MoE routing recorded and replayed (the
  replay equals the recording, a changed routing changes the logprobs), and a bfloat16
  weight push (logprobs then equal transformers on the pushed weights);
* HF tiny Llama and Mixtral -> ``scripts/convert_hf_to_megatron.py`` -> ``megatron:``
  served by the engine with each backend (float32 and bfloat16), and ``hf:`` directly,
  vs transformers (float32: max difference; bfloat16: mean difference against
  transformers' own bfloat16 deviation, since bf16 rounding flips MoE routing);
* start-up of ``megascore serve --model bench-8b`` (Llama-3-8B's shape, random
  weights): start to healthy;
* tokens/s and MFU (model FLOP/s over the GPU's dense bfloat16 peak, and over a
  measured ``torch.mm``) of the ``bench`` model and of ``bench-8b``;
* host syncs in one engine step (torch.profiler: synchronising CUDA calls, and the
  ops that read a device value on the host);
* shared prefixes (``scripts/gpu_prefix_sharing.py``): a GRPO batch scored by a dense
  and a shared engine (torch backend), logprob parity and tokens/s against the ideal
  ratio, on ``bench`` and ``bench-8b``.

Without CUDA every GPU row is ``SKIP`` with "no CUDA" and the script exits 0.
``--device cpu`` runs the rows on the CPU instead (float32, torch backend; the
8B-shaped rows say why not): a dry run of the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
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
BUDGET_S = 450.0  # no row starts after this: the whole check stays within 8 minutes
BIG = "bench-8b"
# Dense bfloat16 peak FLOP/s (no sparsity) by a word of torch.cuda.get_device_name().
BF16_PEAK = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
)
GPU_ROWS = (
    "tests/gpu",
    "serve --device cuda (CLI)",
    "serve --device cpu on the CUDA host (CLI)",
    "routing record -> replay (SDK)",
    "bf16 push (SDK)",
    "checkpoint round trip",
    f"start-up {BIG}",
    "tokens/s and MFU bench",
    f"tokens/s and MFU {BIG}",
    "host syncs per step",
    "prefix sharing vs dense bench",
    f"prefix sharing vs dense {BIG}",
)


RESULTS = ("PASS", "FAIL", "SKIP", "WARN")


class Table:
    """The rows printed at the end (and as they come, on stderr)."""

    def __init__(self):
        self.rows: list[tuple[str, str, float, str]] = []
        self.start = time.monotonic()
        self.budget_s = BUDGET_S  # None: no budget (the CPU dry run)

    def add(self, check: str, result: str, seconds: float = 0.0, detail: str = "") -> None:
        detail = " ".join(str(detail).split())[:160].replace("|", "/")
        self.rows.append((check, result, seconds, detail))
        print(f"gpu_check: {check}: {result} {detail}", file=sys.stderr, flush=True)

    def over_budget(self, check: str) -> bool:
        """True (and a SKIP row) once the check has used its time budget."""
        spent = time.monotonic() - self.start
        over = self.budget_s is not None and spent > self.budget_s
        if over:
            self.add(
                check, "SKIP", detail=f"time budget: {spent:.0f} s spent of {self.budget_s:.0f}"
            )
        return over

    def run(self, check: str, fn, *args) -> None:
        if self.over_budget(check):
            return
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
        counts = {r: sum(1 for row in self.rows if row[1] == r) for r in RESULTS}
        print("gpu_check: " + ", ".join(f"{counts[r]} {r.lower()}" for r in RESULTS))
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
    if not HAVE_TE:
        table.add(
            "TransformerEngine",
            "WARN",
            detail="absent: TE attention, fused RoPE and grouped-GEMM experts are not checked; "
            "every row runs the torch backend",
        )
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


def serve_e2e(device: str, dtype: str, out: Path) -> tuple[str, str]:
    """``megascore serve`` subprocess, then health / info / score with the CLI, then SIGTERM."""
    with Served("tiny", device, dtype, out / f"serve_{device}.log") as server:
        server.wait_healthy()
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


def sdk_rows(table: Table, device: str, dtype: str, out: Path) -> None:
    """Routing record -> replay and a bf16 push, through the SDK on a served HF Mixtral."""
    names = ("routing record -> replay (SDK)", "bf16 push (SDK)")
    if table.over_budget(names[0]):
        return
    import numpy as np
    import torch

    from megascore_client import ScoringClient
    from testkit.checkpoints import (
        hf_logprobs,
        make_hf_model,
        token_batch,
        write_hf_checkpoint,
    )

    start = time.monotonic()
    try:
        hf = out / "hf_mixtral_sdk"
        write_hf_checkpoint("mixtral", hf)
        ids = token_batch()
        seqs = ids.tolist()
        server = Served(f"hf:{hf}", device, dtype, out / "serve_sdk.log")
        with server, ScoringClient(server.target, timeout=120) as client:
            server.wait_healthy()
            table.run(names[0], _routing_replay, client, seqs)
            start = time.monotonic()
            # New weights (another seed) rounded to bfloat16, pushed as bfloat16; the
            # reference is transformers in float32 on the rounded weights (buffers such
            # as RoPE's frequencies stay float32, as in the server).
            new = make_hf_model("mixtral", seed=1)
            with torch.no_grad():
                for param in new.parameters():
                    param.copy_(param.to(torch.bfloat16))
            bf16 = ((k, v.to(torch.bfloat16)) for k, v in new.state_dict().items())
            pushed = client.push_weights(bf16, weights_version="bf16-push")
            got = client.score(seqs)
            ref = hf_logprobs(new, ids)
            lp = np.stack([np.asarray(x[1:], dtype=np.float64) for x in got.logprobs])
            dev = np.abs(lp - ref)
            diff, tol = (dev.max(), FP32_TOL) if dtype == "float32" else (dev.mean(), BF16_FLOOR)
            ok = diff <= tol and got.weights_version == "bf16-push"
            detail = (
                f"{pushed.num_bytes / 2**20:.1f} MiB bf16 in {pushed.seconds:.2f} s; version "
                f"{got.weights_version}; logprobs vs transformers on the pushed weights "
                f"{diff:.2e} (tol {tol:.0e})"
            )
            table.add(names[1], "PASS" if ok else "FAIL", time.monotonic() - start, detail)
            if server.stop() != 0:
                table.add("serve (SDK rows)", "FAIL", detail="server exit non-zero after SIGTERM")
    except Exception as e:  # noqa: BLE001 - the rows not yet written fail with the reason
        done = {row[0] for row in table.rows}
        for name in names:
            if name not in done:
                table.add(name, "FAIL", time.monotonic() - start, f"{type(e).__name__}: {e}")


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


def _engine_logprobs(model: str, device: str, dtype: str, backend: str, ids) -> tuple:
    """Logprobs ``[b, s-1]`` of ``ids`` from a world-size-1 engine, and its backend."""
    import numpy as np

    from megascore.api.types import ScoreBatch
    from megascore.config import EngineConfig
    from megascore.engine.runtime import DistributedEngine

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
    from megascore_server.ports import pick_port
    from testkit.checkpoints import (
        hf_logprobs,
        make_hf_model,
        token_batch,
        write_hf_checkpoint,
    )

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(pick_port()), RANK="0")
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
        convert += [str(pick_port()), str(ROOT / "scripts" / "convert_hf_to_megatron.py")]
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


def startup(device: str, out: Path) -> tuple[str, str]:
    """``megascore serve --model bench-8b``: seconds from start to SERVING."""
    if device != "cuda":
        return "SKIP", f"{BIG} needs 32 GB in float32 on the CPU: run on a GPU (16 GB bf16)"
    with Served(BIG, device, "bfloat16", out / "serve_8b.log") as server:
        seconds = server.wait_healthy(timeout=240)
        code = server.stop()
    if code != 0:
        return "FAIL", f"server exited {code} after SIGTERM"
    return "PASS", f"start -> SERVING {seconds:.1f} s (random weights, bfloat16)"


def _bench():
    """bench/common.py (the benchmarks' engine, workloads and FLOP counts)."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    import common

    common.quiet_logs()
    return common


def _peak(device: str) -> tuple[float, str]:
    import torch

    if device != "cuda":
        return 0.0, "CPU"
    name = torch.cuda.get_device_name(0)
    return next((peak for word, peak in BF16_PEAK if word in name), 0.0), name


def throughput(model: str, device: str) -> tuple[str, str]:
    """tokens/s and MFU of the in-process engine on the rollout workload (one rank)."""
    if device != "cuda" and model == BIG:
        return "SKIP", f"{model} needs 32 GB in float32 on the CPU: run on a GPU"
    common = _bench()
    max_tokens = 16384 if device == "cuda" else 1024
    engine = common.create_engine(device, model)
    try:
        info = engine.info()
        workload = common.make_workloads(16 if device == "cuda" else 4, 0, info.vocab_size)[0]
        common.engine_pass(engine, workload, max_tokens)  # warm-up
        result = common.engine_pass(engine, workload, max_tokens)
        flops = common.model_flops(engine.loaded.config, info.num_parameters, workload.lengths)
    finally:
        engine.shutdown()
    tokens = int(workload.lengths.sum())
    rate = flops / result.seconds
    mm = common.matmul_flops_per_s(device, 8192 if device == "cuda" else 2048, 5)[0]
    peak, name = _peak(device)
    vs_peak = f"MFU {rate / peak:.3f} of {name} bf16 peak" if peak else f"no peak known for {name}"
    detail = (
        f"{tokens / result.seconds:,.0f} tokens/s ({tokens} tokens); {rate / 1e12:.2f} TFLOP/s; "
        f"{vs_peak}; {rate / mm:.3f} of torch.mm"
    )
    return "PASS", detail


# Host syncs: CUDA runtime calls that block the host, and the ops that read a device
# value on the host (each is a sync on a GPU; on the CPU they are counted, not timed).
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
_SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::tolist")


def host_syncs(device: str) -> tuple[str, str]:
    """torch.profiler over one engine step (bench; tiny on the CPU): syncs per step and layer."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    common = _bench()
    engine = common.create_engine(device, "bench" if device == "cuda" else "tiny")
    try:
        info = engine.info()
        workload = common.make_workloads(8, 0, info.vocab_size)[0]
        limit = info.max_sequence_length
        batch = common.score_batch([seq[:limit] for seq in workload.sequences[:8]])
        engine.score(batch)  # warm-up
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            engine.score(batch)
            if device == "cuda":
                torch.cuda.synchronize()
        layers = engine.loaded.config.num_layers
    finally:
        engine.shutdown()
    counts = {e.key: e.count for e in prof.key_averages() if e.key in _SYNC_CALLS + _SYNC_OPS}
    calls = sum(n for k, n in counts.items() if k in _SYNC_CALLS)
    ops = sum(n for k, n in counts.items() if k in _SYNC_OPS)
    where = ", ".join(f"{k.split('::')[-1]} {n}" for k, n in sorted(counts.items())) or "none"
    what = f"{calls} blocking CUDA calls, " if device == "cuda" else ""
    detail = (
        f"one step of {info.name}, 8 sequences, {layers} layers: {what}{ops} host reads of "
        f"device values ({ops / layers:.1f} per layer): {where}"
    )
    return "PASS", detail


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
    if device == "cpu":
        table.budget_s = None  # the 8 minutes are a GPU's; the CPU dry run runs every row
    gpu_tests(table, out)
    table.run(f"serve --device {device} (CLI)", serve_e2e, device, dtype, out)
    if device == "cuda":
        table.run("serve --device cpu on the CUDA host (CLI)", serve_e2e, "cpu", "float32", out)
    sdk_rows(table, device, dtype, out)
    if not table.over_budget("checkpoint round trip"):
        round_trip(table, device, out / "round_trip")
    table.run(f"start-up {BIG}", startup, device, out)
    table.run("host syncs per step", host_syncs, device)
    for model in ("bench", BIG):
        table.run(f"tokens/s and MFU {model}", throughput, model, device)
    for model in ("bench", BIG):
        table.run(f"prefix sharing vs dense {model}", shared_prefix_row, model, device, dtype)
    return table.print()


def shared_prefix_row(model: str, device: str, dtype: str) -> tuple[str, str]:
    """``scripts/gpu_prefix_sharing.py`` on ``model`` (the 8B shape on a GPU only)."""
    if device != "cuda" and model == BIG:
        return "SKIP", f"{model} needs 32 GB in float32 on the CPU: run on a GPU"
    import gpu_prefix_sharing

    _bench().single_rank_env()
    return gpu_prefix_sharing.prefix_sharing(model, device, dtype)


if __name__ == "__main__":
    sys.exit(main())

"""Weight push (``UpdateWeights``) vs ``LoadWeights`` vs the loopback gRPC ceiling, one run.

``python bench/weight_push.py [--reps 5]`` writes its section of ``bench/RESULTS.md``
(between the ``weight_push.py`` markers; ``run_all.py`` keeps it).

The ``bench`` architecture (95.5M parameters) as a ``transformers`` LlamaForCausalLM
with random weights, saved once as a local HF checkpoint. Two ``megascore serve
--model hf:DIR`` subprocesses (fp32 and ``--dtype bfloat16``) and a *loopback sink*
subprocess: a bare ``grpc.aio`` server with the same ``UpdateWeights`` method that
parses every message (same protobuf) and drops it. Interleaved per repetition:

* push fp32: ``ScoringClient.push_weights(state_dict)`` into the fp32 server (stream,
  per-rank staging, swap), and the same messages into the sink;
* push bf16: the state dict in bf16 (raw 2-byte elements on the wire) into the bf16
  server, and into the sink;
* ``LoadWeights hf:DIR`` (the checkpoint on the local disk, page cache warm) into each;
* delta pushes into the bf16 server (``push_weights(..., delta=True)`` from a client
  of their own): a full push that the server keeps, then the state dict with 1% of
  every tensor's elements changed (sign flipped), then 10% more changed: bytes sent
  and seconds vs the full bf16 push of the same repetition.

Target: push bytes/s >= 90 % of the loopback bytes/s of the same messages (the
best a Python gRPC client-streaming call on this machine does). After the first
fp32 push the server's logprobs are checked against the pushed model's own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common
import numpy as np

from megascore_server.ports import pick_port
from megascore_server.procfs import cpu_seconds
from megascore_server.serve_process import ServeProcess

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- weight_push.py: begin -->", "<!-- weight_push.py: end -->"
TARGET = 0.9
DELTA_FRACTIONS = (0.01, 0.10)


def run_sink(port: int) -> None:
    """The loopback sink: UpdateWeights that parses and drops every message."""
    import grpc

    from megascore.v1 import scoring_pb2 as pb

    async def update(requests, context):
        num_bytes = tensors = 0
        async for message in requests:
            if message.WhichOneof("step") == "chunk":
                num_bytes += len(message.chunk.data.data)
                tensors += message.chunk.offset == 0
        return pb.UpdateWeightsResponse(
            weights_version="sink", num_bytes=num_bytes, num_tensors=tensors
        )

    async def serve() -> None:
        limit = 256 * 1024 * 1024
        options = [("grpc.max_receive_message_length", limit)]
        server = grpc.aio.server(options=options)
        handler = grpc.stream_unary_rpc_method_handler(
            update,
            request_deserializer=pb.UpdateWeightsRequest.FromString,
            response_serializer=pb.UpdateWeightsResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "megascore.v1.Scorer", {"UpdateWeights": handler}
                )
            ]
        )
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def _threads() -> dict[str, str]:
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}


def _start_sink(port: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, **_threads())
    cmd = [sys.executable, __file__, "--sink", str(port)]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115


def _hf_model(dtype):
    import torch
    import transformers

    from megascore.model.config import builtin_model

    torch.manual_seed(0)
    config = common.hf_llama_config(builtin_model(common.MODEL), torch.float32)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # logits spread over several nats (HF's 0.02 init is near uniform)
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_((1.0 if "embed" in name else 2.0) / (0.02 * p.shape[-1] ** 0.5))
    return model


def _check_parity(client, model) -> float:
    import torch

    seq = np.random.default_rng(0).integers(0, model.config.vocab_size, 64)
    with torch.no_grad():
        logits = model(torch.tensor(seq[None])).logits[0].double()
    ref = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(seq[1:, None]))[:, 0]
    served = client.score([seq]).logprobs[0][1:].astype(np.float64)
    return float(np.abs(served - ref.numpy()).max())


def _changed(state: dict, fraction: float, seed: int) -> dict:
    """``state`` with ``fraction`` of each tensor's elements (drawn with repeats) changed."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in state.items():
        tensor = tensor.clone()
        flat = tensor.view(-1)
        idx = torch.randint(flat.numel(), (max(1, int(flat.numel() * fraction)),), generator=gen)
        flat[idx] = -flat[idx] - 1e-3
        out[name] = tensor
    return out


def _deltas(client, state: dict, rep: int, res: dict) -> None:
    """A kept full push, then 1% and 10% changed as deltas (bytes, seconds)."""
    base = client.push_weights(state.items(), delta=True, weights_version=f"dbase-{rep}")
    assert not base.delta
    for fraction in DELTA_FRACTIONS:
        state = _changed(state, fraction, seed=100 * rep + int(fraction * 100))
        pushed = client.push_weights(
            state.items(), delta=True, weights_version=f"d{fraction}-{rep}"
        )
        assert pushed.delta
        res["delta"].setdefault(fraction, []).append(pushed)


def measure(reps: int, workdir: Path) -> dict:
    import torch

    from megascore_client import ScoringClient

    model = _hf_model(torch.float32)
    ckpt = workdir / "bench-hf"
    model.save_pretrained(ckpt)
    states = {
        "fp32": dict(model.state_dict()),
        "bf16": {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()},
    }
    sink_port = pick_port()
    sink = _start_sink(sink_port, workdir / "sink.log")
    servers = {}
    for name, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        flags = ["--model", f"hf:{ckpt}", "--dtype", dtype, "--grace-s", "2"]
        servers[name] = ServeProcess(workdir / f"{name}.log", *flags, env=_threads())
    targets = {name: s.target for name, s in servers.items()} | {"sink": f"127.0.0.1:{sink_port}"}
    clients = {n: ScoringClient(t, timeout=600) for n, t in targets.items()}
    clients["delta"] = ScoringClient(targets["bf16"], timeout=600)
    res: dict = {"push": {}, "sink": {}, "load": {}, "bytes": {}, "delta": {}, "cpu": {}}
    pids = {"sink": sink.pid} | {name: s.pid for name, s in servers.items()}
    try:
        for name in ("fp32", "bf16"):
            servers[name].wait_serving(timeout=600)
        time.sleep(1.0)  # the sink is up long before the servers
        for rep in range(reps):
            for dtype in ("fp32", "bf16"):
                before = cpu_seconds(pids[dtype])
                pushed = clients[dtype].push_weights(
                    states[dtype].items(), version=f"{dtype}-{rep}"
                )
                between = cpu_seconds(pids["sink"])
                server_cpu = cpu_seconds(pids[dtype]) - before
                sunk = clients["sink"].push_weights(states[dtype].items())
                sink_cpu = cpu_seconds(pids["sink"]) - between
                res["cpu"].setdefault(dtype, []).append((server_cpu, sink_cpu))
                assert sunk.num_bytes == pushed.num_bytes
                res["push"].setdefault(dtype, []).append(pushed)
                res["sink"].setdefault(dtype, []).append(sunk)
                res["bytes"][dtype] = pushed.num_bytes
                if rep == 0 and dtype == "fp32":
                    res["parity"] = _check_parity(clients["fp32"], model)
                if dtype == "bf16":
                    _deltas(clients["delta"], states["bf16"], rep, res)
                start = time.perf_counter()
                clients[dtype].load_weights(f"hf:{ckpt}", f"load-{rep}")
                res["load"].setdefault(dtype, []).append(time.perf_counter() - start)
                common_log(
                    f"rep {rep} {dtype}: push {pushed.bytes_per_s / 1e6:.0f} MB/s, "
                    f"sink {sunk.bytes_per_s / 1e6:.0f} MB/s, load {res['load'][dtype][-1]:.2f} s"
                )
        res["load_end"] = common.machine_info("cpu")["load average"]
        res["num_parameters"] = sum(t.numel() for t in states["fp32"].values())
        res["checkpoint_bytes"] = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    finally:
        for client in clients.values():
            client.close()
        sink.terminate()
        for server in servers.values():
            server.stop(grace=60)
        try:
            sink.wait(60)
        except subprocess.TimeoutExpired:
            sink.kill()
    return res


def common_log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def section(res: dict, reps: int, machine: dict, elapsed: float) -> str:
    """The markdown section of RESULTS.md."""
    med = statistics.median
    lines = [
        BEGIN,
        "## Weight push (UpdateWeights)",
        "",
        f"Written by `python bench/weight_push.py --reps {reps}` in {elapsed / 60:.1f} min "
        f"({machine['date']}, load average {machine['load average']} at the start, "
        f"{res['load_end']} at the end); "
        "rerun it to update this section.",
        "",
        f"* model `bench` as a transformers LlamaForCausalLM: {res['num_parameters'] / 1e6:.1f}M "
        f"parameters; pushed as its `state_dict()` (HF names, full tensors, 8 MiB chunks); "
        f"LoadWeights reads the same weights from a local HF checkpoint "
        f"({res['checkpoint_bytes'] / 1e6:.0f} MB fp32 safetensors)",
        "* loopback: the same `push_weights` messages into a bare grpc.aio UpdateWeights on "
        "127.0.0.1 that parses and drops them",
        f"* {reps} repetitions, interleaved; the median is reported; server logprobs after the "
        f"first fp32 push vs the pushed model: max abs diff {res['parity']:.1e}",
        "",
        "| dtype | MB | push s | push MB/s | loopback MB/s | push / loopback | "
        "target | result | server CPU s: push / loopback | LoadWeights s |",
        "|---|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    met = 0
    for dtype in ("fp32", "bf16"):
        push = [p.bytes_per_s for p in res["push"][dtype]]
        sink = [s.bytes_per_s for s in res["sink"][dtype]]
        ratios = [p / s for p, s in zip(push, sink, strict=True)]
        ratio = med(ratios)
        ok = ratio >= TARGET
        met += ok
        seconds = med(p.seconds for p in res["push"][dtype])
        server_cpu, sink_cpu = (med(c[i] for c in res["cpu"][dtype]) for i in (0, 1))
        lines.append(
            f"| {dtype} | {res['bytes'][dtype] / 1e6:.0f} | {seconds:.2f} | "
            f"{med(push) / 1e6:.0f} | {med(sink) / 1e6:.0f} | {ratio:.2f} "
            f"(reps {min(ratios):.2f}..{max(ratios):.2f}) | >= {TARGET} | "
            f"{'pass' if ok else 'MISS'} | {server_cpu:.2f} / {sink_cpu:.2f} | "
            f"{med(res['load'][dtype]):.2f} |"
        )
    full = res["push"]["bf16"]
    lines += [
        "",
        "Delta pushes into the bf16 server (`push_weights(..., delta=True)`; changed "
        "elements drawn per tensor, sign flipped; each delta against the previous push):",
        "",
        "| changed | MB sent | full MB | bytes / full | delta s | full s | time / full |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for fraction in DELTA_FRACTIONS:
        deltas = res["delta"][fraction]
        sent = med(d.num_bytes for d in deltas)
        seconds = [d.seconds / f.seconds for d, f in zip(deltas, full, strict=True)]
        lines.append(
            f"| {fraction:.0%} | {sent / 1e6:.1f} | {res['bytes']['bf16'] / 1e6:.0f} | "
            f"{sent / res['bytes']['bf16']:.3f} | {med(d.seconds for d in deltas):.2f} | "
            f"{med(f.seconds for f in full):.2f} | {med(seconds):.2f} |"
        )
    swap = med(p.server_swap_ms for p in res["push"]["fp32"])
    lines += [
        "",
        f"{met} of 2 targets met. Of a push, the swap (waiting for the queue, then every "
        f"rank putting its staged shards in) took {swap:.0f} ms (fp32, median); the rest is "
        "the stream, the tensors staged on the engine thread while the next ones arrive. "
        "Both sides of each ratio ran back to back; the load average (machine table above "
        "and here) says how busy the shared machine was. Server CPU: seconds of CPU (every "
        "thread) the megascore server, and the loopback sink, spent on one push (median), "
        "the client's being the same on both sides: what the push adds, less sensitive to "
        "the machine's load than bytes/s.",
        END,
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    p.add_argument("--sink", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.sink is not None:
        run_sink(args.sink)
        return 0
    common.quiet_logs()
    common.run_own_section(
        "megascore-push-bench-",
        (BEGIN, END),
        args.output,
        lambda workdir: measure(args.reps, workdir),
        lambda res, machine, elapsed: section(res, args.reps, machine, elapsed),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

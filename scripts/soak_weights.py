"""The changing-weights soak (``scripts/soak.py --changing-weights``), issue 36.

A replica set of ``tiny-moe`` servers (replica 0: one rank; replica 1: ``--nproc 2
--tensor-model-parallel-size 2``), both batch-invariant and without prefix sharing (every
answer then has exactly one right value per layout), and two reference servers of the
same layouts that only this script talks to. While the clients of
:mod:`soak_clients` score through the set:

* the **trainer** loop changes 1 % of the elements of five tensors (embedding, output
  layer, final norm, both routers) every ``--push-every`` seconds and pushes them to the
  live replicas, all or none (the SDK's replica push; most pushes ``delta=True``, every
  fifth in full), after pushing the same tensors to the reference servers and scoring
  every case there (so a version has its references before any replica serves it);
  every ``--load-every``-th step is a ``LoadWeights`` of the start-up weights under a new
  label instead. After each push it asks every replica that stayed up which version it
  serves: all the new one, or (failed push) none of them;
* the **chaos** loop, every ``--kill-every`` seconds, takes replica 0 down, in turn
  SIGKILL of its rank 0 at a random moment and SIGTERM of the server while a push
  streams to it, then restarts it on the same port (it comes back with its start-up
  weights and takes the next push).

Resources of every process are sampled (:mod:`soak_resources`). The last line:
``soak: PASS|FAIL ... wrong W, stale S ...``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import soak_report
from soak_clients import Clients, Ledger, make_cases, result_fingerprints
from soak_resources import ResourceSampler, write_csv

from megascore.v1 import scoring_pb2_grpc as pb_grpc
from megascore_client import ScoringClient, ScoringError
from megascore_server.ports import pick_port
from megascore_server.serve_process import CPU_ONE_THREAD, MEGASCORE, ServeProcess

MODEL = "tiny-moe"
BASE_SPEC = "builtin:tiny-moe@1234"
COMMON_FLAGS = ("--model", MODEL, "--batch-invariant", "--no-prefix-sharing", "--grace-s", "10")
LAYOUTS = {"tp1": (), "tp2": ("--nproc", "2", "--tensor-model-parallel-size", "2")}
HIDDEN, VOCAB, EXPERTS = 64, 512, 4
TENSORS = {
    "embedding.word_embeddings.weight": (VOCAB, HIDDEN),
    "output_layer.weight": (VOCAB, HIDDEN),
    "decoder.final_layernorm.weight": (HIDDEN,),
    "decoder.layers.0.mlp.router.weight": (EXPERTS, HIDDEN),
    "decoder.layers.1.mlp.router.weight": (EXPERTS, HIDDEN),
}


def http_front_available(env: dict) -> bool:
    """Whether ``megascore serve --help`` lists ``--http-port``."""
    proc = subprocess.run(
        [str(MEGASCORE), "serve", "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    return "--http-port" in proc.stdout


class Replica:
    """One server of the run, restartable on its port."""

    def __init__(self, name: str, layout: str, log_dir: Path, http: bool):
        self.name, self.layout, self.log_dir = name, layout, log_dir
        self.port = pick_port()
        self.http_port = pick_port() if http else None
        self.incarnation, self.up, self.server = 0, False, None

    def start(self) -> None:
        self.incarnation += 1
        flags = [*COMMON_FLAGS, *LAYOUTS[self.layout]]
        if self.http_port:
            flags += ["--http-port", str(self.http_port)]
        log = self.log_dir / f"{self.name}-{self.incarnation}.log"
        self.server = ServeProcess(log, *flags, port=self.port, env=CPU_ONE_THREAD)

    def wait_up(self) -> None:
        self.server.wait_serving()
        self.up = True

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def pids(self) -> list[int]:
        return self.server.tree() if self.up else []


class References:
    """The reference servers: each version's weights, then every case scored alone."""

    def __init__(self, servers: list[Replica], ledger: Ledger):
        self.servers, self.ledger = servers, ledger
        self.clients = [ScoringClient(s.target, timeout=300, retries=None) for s in servers]

    def score(self, version: str) -> None:
        for client in self.clients:
            for i, case in enumerate(self.ledger.cases):
                result = client.score(case, top_k=2, losses=("nll",))
                assert result.weights_version == version, (result.weights_version, version)
                self.ledger.add_reference(version, i, result_fingerprints(result))

    def push(self, version: str, tensors: dict) -> None:
        self.clients[0].push_weights(
            tensors.items(),
            names="megatron",
            partial=True,
            weights_version=version,
            replicas=[s.target for s in self.servers],
        )
        self.score(version)

    def load(self, version: str) -> None:
        for client in self.clients:
            client.load_weights(BASE_SPEC, weights_version=version)
        self.score(version)

    def close(self) -> None:
        for client in self.clients:
            client.close()


class Trainer:
    """Pushes (and now and then loads) new weights; see the module docstring."""

    def __init__(self, replicas, refs, ledger, args, chaos):
        self.replicas, self.refs, self.ledger, self.args = replicas, refs, ledger, args
        self.chaos = chaos
        rng = np.random.default_rng(36)
        self.tensors = {
            n: (rng.standard_normal(s) * 0.05 + (1.0 if len(s) == 1 else 0.0)).astype(np.float32)
            for n, s in TENSORS.items()
        }
        self.client = ScoringClient(replicas[-1].target, timeout=300, retries=None)
        self.stats = collections.Counter()
        self.failed = collections.Counter()  # push / load failures by code
        self.splits: list[str] = []
        self.errors: list[str] = []
        self.push_seconds: list[float] = []

    def next_tensors(self, step: int) -> dict:
        rng = np.random.default_rng(step)
        out = {}
        for name, tensor in self.tensors.items():
            new = tensor.copy()  # the SDK keeps the last delta push's arrays as its base
            picked = rng.choice(new.size, max(1, new.size // 100), replace=False)
            new.flat[picked] += rng.standard_normal(picked.size).astype(np.float32) * 0.02
            out[name] = new
        return out

    def run(self, stop: threading.Event) -> None:
        step = 0
        while not stop.wait(self.args.push_every):
            step += 1
            try:
                if step % self.args.load_every == 0:
                    self.load(step)
                else:
                    self.push(step)
            except Exception as exc:  # the reference servers never fail; nor does this
                self.errors.append(f"step {step}: {type(exc).__name__}: {exc}")

    def _versions(self, live, incarnations) -> dict[str, str]:
        """What each replica that stayed up (same incarnation) serves now."""
        out = {}
        for r in live:
            if not r.up or r.incarnation != incarnations[r.name]:
                continue
            try:
                with ScoringClient(r.target, timeout=10, retries=None) as client:
                    out[r.name] = client.model_info().weights_version
            except ScoringError:
                continue  # going down right now
        return out

    def push(self, step: int) -> None:
        version = f"soak-{step}"
        tensors = self.next_tensors(step)
        self.tensors = tensors
        self.refs.push(version, tensors)
        live = [r for r in self.replicas if r.up]
        incarnations = {r.name: r.incarnation for r in live}
        started = []

        def progress(sent, name):
            if not started:
                started.append(name)
                self.chaos.on_push_started()

        delta = step % 5 != 1
        begin = time.monotonic()
        try:
            result = self.client.push_weights(
                tensors.items(),
                names="megatron",
                partial=True,
                delta=delta,
                weights_version=version,
                replicas=[r.target for r in live],
                chunk_bytes=16384,
                progress=progress,
                prepare_timeout_s=30,
                timeout=180,
            )
        except ScoringError as exc:
            result = None
            self.failed[f"push {exc.code.name}"] += 1
        self.push_seconds.append(time.monotonic() - begin)
        served = self._versions(live, incarnations)  # the replicas that stayed up
        if len(set(served.values())) > 1 or (result is not None and version not in served.values()):
            self.splits.append(f"{version} {'committed' if result else 'failed'}: {served}")
        if result is not None:
            self.stats["pushes"] += 1
            self.stats["deltas" if result.delta else "full pushes"] += 1
            self.stats["bytes pushed"] += result.num_bytes
            self.ledger.promote(version)
        elif served and set(served.values()) == {version}:
            # failed in the commit phase on a replica going down: the live ones committed
            self.stats["pushes committed on the live replicas only"] += 1
            self.ledger.promote(version)

    def load(self, step: int) -> None:
        version = f"load-{step}"
        self.refs.load(version)
        for r in [r for r in self.replicas if r.up]:
            try:
                with ScoringClient(r.target, timeout=120, retries=None) as client:
                    client.load_weights(BASE_SPEC, weights_version=version)
            except ScoringError as exc:
                self.failed[f"load {exc.code.name}"] += 1
        self.stats["loads"] += 1
        self.ledger.promote(version)


class Chaos:
    """Takes replica ``victim`` down every ``every_s`` seconds and restarts it."""

    def __init__(self, victim: Replica, every_s: float, push_every: float):
        self.victim, self.every_s, self.push_every = victim, every_s, push_every
        self.stats = collections.Counter()
        self.problems: list[str] = []
        self.down_s: list[float] = []
        self._armed = threading.Event()
        self._fired = threading.Event()

    def on_push_started(self) -> None:
        """Called by the trainer (from the push's progress callback, so the push waits)
        when a push begins to stream: once the victim holds it open, SIGTERM."""
        if self._armed.is_set() and self.victim.up:
            self._armed.clear()
            if _push_open(self.victim.target, timeout=10.0):
                self._kill(signal.SIGTERM, "SIGTERM during a push")
                self._fired.set()

    def _kill(self, sig, label: str) -> None:
        server = self.victim.server
        pid = server.rank_pids().get(0, server.pid) if sig == signal.SIGKILL else server.pid
        self.victim.up = False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        self.stats[label] += 1

    def run(self, stop: threading.Event) -> None:
        rounds = 0
        while not stop.wait(self.every_s):
            rounds += 1
            down = time.monotonic()
            try:
                self._round(rounds % 2 == 1, stop)
            except Exception as exc:  # e.g. the restarted replica never came up
                self.problems.append(f"chaos round {rounds}: {type(exc).__name__}: {exc}")
            self.down_s.append(time.monotonic() - down)

    def _round(self, sigkill: bool, stop: threading.Event) -> None:
        if sigkill:
            self._kill(signal.SIGKILL, "SIGKILL")
        else:
            self._fired.clear()
            self._armed.set()
            if not self._fired.wait(self.push_every * 4):
                self._armed.clear()
                if not self._fired.is_set():
                    self._kill(signal.SIGTERM, "SIGTERM between pushes")
        self._restart(not sigkill, stop)

    def _restart(self, graceful: bool, stop: threading.Event) -> None:
        server = self.victim.server
        try:
            code = server.proc.wait(120)
        except subprocess.TimeoutExpired:
            code = None
        if graceful and code != 0:
            self.problems.append(f"{self.victim.name} exited {code} after SIGTERM")
        if stop.is_set():  # the run is over: it stays down
            return
        server.close()
        self.victim.start()
        self.victim.wait_up()
        self.stats["restarts"] += 1


def _push_open(target: str, timeout: float) -> bool:
    """Waits until ``target`` refuses a push of its own as "in progress" (one is open
    there; an empty stream is refused at once otherwise)."""
    end = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ScorerStub(channel)
        while time.monotonic() < end:
            try:
                stub.UpdateWeights(iter([]), timeout=5)
            except grpc.RpcError as exc:
                if exc.code() is grpc.StatusCode.ABORTED and "in progress" in exc.details():
                    return True
            time.sleep(0.01)
    return False


def run_changing(args) -> int:
    """The whole run; returns the exit code (1 on any problem)."""
    load_start = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="megascore-soak36-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    http = http_front_available(env) and not args.no_http
    print(f"soak: changing weights, {args.duration:.0f} s, logs {log_dir}, http {http}", flush=True)
    replicas = [
        Replica("replica-tp1", "tp1", log_dir, http),
        Replica("replica-tp2", "tp2", log_dir, http),
    ]
    ref_servers = [
        Replica("ref-tp1", "tp1", log_dir, False),
        Replica("ref-tp2", "tp2", log_dir, False),
    ]
    everyone = replicas + ref_servers
    ledger = Ledger(make_cases(args.cases, args.seed, args.max_len))
    try:
        for r in everyone:
            r.start()
        for r in everyone:
            r.wait_up()
        refs = References(ref_servers, ledger)
        with ScoringClient(ref_servers[0].target) as client:
            base = client.model_info().weights_version
        refs.score(base)
        ledger.promote(base)
        chaos = Chaos(replicas[0], args.kill_every, args.push_every)
        trainer = Trainer(replicas, refs, ledger, args, chaos)
        roles = {"soak": lambda: [os.getpid()]} | {r.name: r.pids for r in everyone}
        sampler = ResourceSampler(roles, args.sample_every)
        target = "ipv4:" + ",".join(r.target for r in replicas)
        http_targets = [f"127.0.0.1:{r.http_port}" for r in replicas] if http else []
        counts = {"unary": args.unary, "async": args.async_, "stream": args.stream, "cli": 1}
        counts["http"] = args.http
        clients = Clients(
            ledger, target, http_targets, args.think_ms / 1e3, counts, log_dir, str(MEGASCORE), env
        )
        stop = threading.Event()
        loops = [
            threading.Thread(target=trainer.run, args=(stop,), daemon=True),
            threading.Thread(target=chaos.run, args=(stop,), daemon=True),
        ]
        start = time.monotonic()
        clients.start()
        for loop in loops:
            loop.start()
        end = start + args.duration
        while not stop.is_set():
            time.sleep(max(0.1, min(args.report_every, end - time.monotonic())))
            elapsed = time.monotonic() - start
            print(soak_report.progress(elapsed, ledger, trainer, chaos, sampler), flush=True)
            if elapsed >= args.duration:
                stop.set()
        for loop in loops:
            loop.join(600)
        stuck = clients.join(300)
        samples = sampler.stop()
        elapsed = time.monotonic() - start
        refs.close()
        trainer.client.close()
        exits = {}
        for r in everyone:
            if not r.up:
                exits[r.name] = "down at the end (chaos)"
                continue
            exits[r.name] = r.server.terminate(timeout=120)
            leftovers = r.server.leftovers()
            if leftovers:
                exits[r.name] = f"{exits[r.name]}, left {leftovers}"
    finally:
        for r in everyone:
            if r.server is not None:
                r.server.close()
    summary = soak_report.summarize(
        args, elapsed, ledger, trainer, chaos, samples, exits, stuck, http
    )
    write_csv(samples, log_dir / "resources.csv")
    (log_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str))
    if args.results:
        soak_report.write_section(
            Path(args.results), soak_report.section(summary, args.argv, load_start)
        )
    print(json.dumps(summary, indent=2, default=str))
    print(summary["line"], flush=True)
    return 1 if summary["problems"] else 0

"""Clients of the changing-weights soak (``scripts/soak.py --changing-weights``) and the
check of every answer they get.

:class:`Ledger` holds the references (per weights version, per case, per sequence: the
fingerprints of the answers the reference servers gave, one per parallel layout) and
what the clients saw. Each answer is checked as it arrives:

* it names a weights version the run made (a push, a load, the start-up weights) and
  equals, bit for bit, a reference scoring of the same sequence at that version
  (otherwise it counts as **wrong**); an answer that names no version (the JSONL CLI,
  an HTTP front without the field) must equal the reference of some known version;
* a pinned request is answered at its pin (otherwise **stale**) or refused
  FAILED_PRECONDITION.

Client kinds: ``unary`` (sync SDK), ``async`` (asyncio SDK), ``stream`` (sync
ScoreStream), ``cli`` (``megascore score`` on a JSONL file, run as a subprocess), and
``http`` (``/v1/completions`` and ``/generate`` of the HTTP front, when the servers have
one). Every SDK client goes through the whole replica set (``ipv4:a,b``, round robin,
``wait_for_server_s``), as an RL trainer's would.
"""

from __future__ import annotations

import array
import asyncio
import collections
import hashlib
import json
import random
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np

from megascore_client import AsyncScoringClient, ScoringClient, ScoringError

TOP_K = 2
LOSSES = ("nll",)
EXPECTED_CODES = ("UNAVAILABLE", "FAILED_PRECONDITION", "CANCELLED at the stop")
"""Failures the run accepts: a replica down (after the SDK's retries and re-sends), a pin
during a switch. A FAILED_PRECONDITION counts as expected only for a pinned request."""


def make_cases(count: int, seed: int, max_len: int, vocab: int = 512) -> list[list[list[int]]]:
    """``count`` batches of 1-3 random sequences of 2..max_len tokens."""
    rng = np.random.default_rng(seed)
    return [
        [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(2, max_len + 1, size)]
        for size in rng.integers(1, 4, count)
    ]


def fingerprint(logprobs, top_ids=None, top_lps=None, nll=None) -> tuple[bytes, bytes]:
    """(logprobs only, logprobs + top-k + nll) digests of one sequence's answer."""
    lp = hashlib.blake2b(np.asarray(logprobs, np.float32).tobytes(), digest_size=12).digest()
    if top_ids is None:
        return lp, b""
    full = hashlib.blake2b(lp, digest_size=12)
    full.update(np.asarray(top_ids, np.int64).tobytes())
    full.update(np.asarray(top_lps, np.float32).tobytes())
    full.update(np.float64(nll).tobytes())
    return lp, full.digest()


def result_fingerprints(result) -> list[tuple[bytes, bytes]]:
    return [
        fingerprint(lp, ids, tlp, nll)
        for lp, ids, tlp, nll in zip(
            result.logprobs,
            result.top_k_ids,
            result.top_k_logprobs,
            result.loss["nll"],
            strict=True,
        )
    ]


class Ledger:
    """References and outcomes, shared by every thread of the run."""

    def __init__(self, cases):
        self.cases = cases
        self.refs: dict[str, list[list[set]]] = {}  # version -> case -> sequence -> fps
        self.current = ""  # the version the last push or load made every live replica serve
        self.retired: list[str] = []  # versions no replica serves any more
        self.calls = collections.Counter()  # kind -> answered calls
        self.tokens = 0
        self.latency_ms = collections.defaultdict(lambda: array.array("d"))
        self.failures = collections.Counter()  # (kind, code) -> count
        self.pinned = collections.Counter()  # answered / refused
        self.wrong: list[str] = []
        self.stale: list[str] = []
        self.unexpected: list[str] = []  # failures outside EXPECTED_CODES
        self.stopping = threading.Event()  # set when the run ends and the clients stop
        self.lock = threading.Lock()

    def add_reference(self, version: str, case: int, fps: list[tuple[bytes, bytes]]) -> None:
        with self.lock:
            table = self.refs.setdefault(version, [[] for _ in self.cases])
            if not table[case]:
                table[case] = [set() for _ in fps]
            for held, fp in zip(table[case], fps, strict=True):
                held.add(fp)

    def promote(self, version: str) -> None:
        with self.lock:
            if self.current and self.current != version:
                self.retired = [*self.retired[-20:], self.current]
            self.current = version

    def pin_for(self, rng: random.Random) -> str:
        """The pin of the next request: the current version (30 %), a retired one (5 %),
        or none."""
        draw = rng.random()
        with self.lock:
            if draw < 0.3:
                return self.current
            if draw < 0.35 and self.retired:
                return rng.choice(self.retired)
        return ""

    def _matches(self, version: str, case: int, fps, part: int) -> bool:
        table = self.refs.get(version)
        if table is None or not table[case] or len(table[case]) != len(fps):
            return False
        return all(
            fp[part] in {h[part] for h in held} for fp, held in zip(fps, table[case], strict=True)
        )

    def check(self, kind, case, fps, version, pin, latency_ms, part: int = 1) -> None:
        """Records one answer (``version`` None: the answer names none)."""
        tokens = sum(len(s) for s in self.cases[case])
        with self.lock:
            self.calls[kind] += 1
            self.tokens += tokens
            self.latency_ms[kind].append(latency_ms)
            if pin:
                self.pinned["answered"] += 1
                if version != pin:
                    self.stale.append(f"{kind} case {case}: pinned {pin!r}, answered {version!r}")
            if version is None:
                ok = any(self._matches(v, case, fps, part) for v in self.refs)
            else:
                ok = self._matches(version, case, fps, part)
            if not ok:
                known = "known" if version is None or version in self.refs else "unknown"
                self.wrong.append(f"{kind} case {case}: differs from {known} version {version!r}")

    def fail(self, kind: str, code: str, pin: str = "", error: BaseException | None = None):
        """Records a failed call. A call cancelled once the run's own stop has begun (the
        clients winding down) is counted apart, as "CANCELLED at the stop", not judged."""
        if code == "CANCELLED" and self.stopping.is_set():
            code = "CANCELLED at the stop"
        with self.lock:
            self.failures[(kind, code)] += 1
            if pin and code == "FAILED_PRECONDITION":
                self.pinned["refused"] += 1
            elif code == "FAILED_PRECONDITION" or code not in EXPECTED_CODES:
                detail = f": {str(error)[:400]}" if error is not None else ""
                at = time.strftime("%H:%M:%S")  # to find it in the replicas' logs
                self.unexpected.append(f"{at} {kind}: failed {code} (pin {pin!r}){detail}")


def _code(exc: BaseException) -> str:
    if isinstance(exc, ScoringError):
        return exc.code.name
    if isinstance(exc, grpc.RpcError):
        return exc.code().name
    return type(exc).__name__


class Clients:
    """Starts the client threads; each runs until ``stop`` is set.

    Args:
        ledger: where answers are checked and recorded.
        target: the replica set (``ipv4:a,b``).
        http_targets: ``host:port`` of each replica's HTTP front (empty: none).
        think_s: pause between two calls of one client (keeps the CPU for the servers).
        counts: clients per kind.
        work_dir: where the CLI's files go.
        env: environment of the CLI subprocess.
    """

    def __init__(self, ledger, target, http_targets, think_s, counts, work_dir, megascore, env):
        self.ledger, self.target, self.http_targets = ledger, target, http_targets
        self.think_s, self.counts, self.work_dir = think_s, counts, Path(work_dir)
        self.megascore, self.env = megascore, env
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def sdk_client(self, cls):
        return cls(self.target, load_balancing="round_robin", timeout=120, wait_for_server_s=60.0)

    def start(self) -> None:
        workers = {
            "unary": self._unary,
            "async": self._async,
            "stream": self._stream,
            "cli": self._cli,
            "http": self._http,
        }
        for kind, count in self.counts.items():
            if kind == "http" and not self.http_targets:
                continue
            for i in range(count):
                thread = threading.Thread(
                    target=self._guard, args=(kind, workers[kind], i), daemon=True
                )
                thread.start()
                self.threads.append(thread)

    def join(self, timeout: float) -> list[str]:
        """Stops the clients; returns the names of those still running after ``timeout``."""
        self.ledger.stopping.set()
        self.stop.set()
        end = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.1, end - time.monotonic()))
        return [t.name for t in self.threads if t.is_alive()]

    def _guard(self, kind, worker, index) -> None:
        rng = random.Random(f"{kind}-{index}")
        while not self.stop.is_set():
            try:
                worker(rng)
            except Exception as exc:  # a client bug must show, not end the thread quietly
                self.ledger.fail(kind, f"client-crash {type(exc).__name__}: {exc}")
                self.stop.wait(1.0)

    def _unary(self, rng) -> None:
        with self.sdk_client(ScoringClient) as client:
            while not self.stop.wait(self.think_s):
                case, pin = rng.randrange(len(self.ledger.cases)), self.ledger.pin_for(rng)
                start = time.perf_counter()
                try:
                    result = client.score(
                        self.ledger.cases[case], top_k=TOP_K, losses=LOSSES, weights_version=pin
                    )
                except ScoringError as exc:
                    self.ledger.fail("unary", _code(exc), pin, exc)
                    continue
                latency = (time.perf_counter() - start) * 1e3
                fps = result_fingerprints(result)
                self.ledger.check("unary", case, fps, result.weights_version, pin, latency)

    def _async(self, rng, tasks: int = 2) -> None:
        async def worker(client, seed):
            local = random.Random(seed)
            while not self.stop.is_set():
                await asyncio.sleep(self.think_s)
                case, pin = local.randrange(len(self.ledger.cases)), self.ledger.pin_for(local)
                start = time.perf_counter()
                try:
                    result = await client.score(
                        self.ledger.cases[case], top_k=TOP_K, losses=LOSSES, weights_version=pin
                    )
                except ScoringError as exc:
                    self.ledger.fail("async", _code(exc), pin, exc)
                    continue
                latency = (time.perf_counter() - start) * 1e3
                fps = result_fingerprints(result)
                self.ledger.check("async", case, fps, result.weights_version, pin, latency)

        async def main():
            async with self.sdk_client(AsyncScoringClient) as client:
                await asyncio.gather(*(worker(client, rng.random()) for _ in range(tasks)))

        asyncio.run(main())

    def _stream(self, rng, window: int = 3) -> None:
        """One ScoreStream at a time: a window of batches in flight; a stream that ends
        (its replica went down, a pin refused) is counted and a new one opened."""
        with self.sdk_client(ScoringClient) as client:
            while not self.stop.is_set():
                inflight = collections.deque()
                try:
                    with client.stream(timeout=600) as stream:
                        opened = time.monotonic()
                        while not self.stop.is_set() and time.monotonic() - opened < 120:
                            while len(inflight) < window:
                                case = rng.randrange(len(self.ledger.cases))
                                pin = self.ledger.pin_for(rng)
                                future = stream.submit(
                                    self.ledger.cases[case],
                                    top_k=TOP_K,
                                    losses=LOSSES,
                                    weights_version=pin,
                                )
                                inflight.append((case, pin, time.perf_counter(), future))
                            result = inflight[0][3].result(timeout=300)
                            case, pin, start, _ = inflight.popleft()
                            latency = (time.perf_counter() - start) * 1e3
                            fps = result_fingerprints(result)
                            self.ledger.check(
                                "stream", case, fps, result.weights_version, pin, latency
                            )
                            self.stop.wait(self.think_s)
                        while inflight:  # the stream closes after its answers
                            result = inflight[0][3].result(timeout=300)
                            case, pin, start, _ = inflight.popleft()
                            latency = (time.perf_counter() - start) * 1e3
                            fps = result_fingerprints(result)
                            self.ledger.check(
                                "stream", case, fps, result.weights_version, pin, latency
                            )
                except (ScoringError, TimeoutError) as exc:
                    # the stream ends at a message it could not answer (a refused pin)
                    # or at once (its replica went down); the messages after fail too
                    pins = [p for _, p, _, f in inflight if p and f.done() and f.exception()]
                    self.ledger.fail("stream", _code(exc), pins[0] if pins else "", exc)
                    self.stop.wait(0.5)

    def _cli(self, rng, every_s: float = 10.0, rows: int = 4) -> None:
        """``megascore score`` on a JSONL of a few cases (every sequence a row); its rows
        name no version: each must equal the reference of some known version."""
        while not self.stop.wait(every_s):
            picked = rng.sample(range(len(self.ledger.cases)), rows)
            src = self.work_dir / "cli-in.jsonl"
            out = self.work_dir / "cli-out.jsonl"
            out.unlink(missing_ok=True)
            with src.open("w") as f:
                for case in picked:
                    for j, seq in enumerate(self.ledger.cases[case]):
                        f.write(json.dumps({"id": f"{case}-{j}", "token_ids": seq}) + "\n")
            start = time.perf_counter()
            args = [self.megascore, "score", "--target", self.target, "--top-k", str(TOP_K)]
            args += ["--load-balancing", "round_robin", "--wait-for-server", "60"]
            args += ["--no-progress", str(src), "-o", str(out)]
            proc = subprocess.run(args, capture_output=True, text=True, env=self.env, timeout=600)
            if proc.returncode != 0:
                self.ledger.fail("cli", f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
                continue
            latency = (time.perf_counter() - start) * 1e3
            got = {}
            for line in out.read_text().splitlines():
                row = json.loads(line)
                case, j = map(int, row["id"].split("-"))
                got[case, j] = fingerprint(
                    row["logprobs"], row["top_k_ids"], row["top_k_logprobs"], row["nll"]
                )
            for case in picked:
                n = len(self.ledger.cases[case])
                fps = [got.get((case, j), (b"", b"")) for j in range(n)]
                self.ledger.check("cli", case, fps, None, "", latency / len(picked))

    def _http(self, rng) -> None:
        """The HTTP front: ``/v1/completions`` (a case's sequences as prompts) and
        ``/generate`` (one sequence) on a random replica; logprobs checked."""
        while not self.stop.wait(self.think_s * 2):
            host = rng.choice(self.http_targets)
            case = rng.randrange(len(self.ledger.cases))
            seqs = self.ledger.cases[case]
            if rng.random() < 0.5:
                route, body = (
                    "/v1/completions",
                    {
                        "prompt": seqs,
                        "echo": True,
                        "max_tokens": 0,
                        "logprobs": 1,
                    },
                )
            else:
                seqs = seqs[:1]
                route, body = (
                    "/generate",
                    {
                        "input_ids": seqs[0],
                        "sampling_params": {"max_new_tokens": 0},
                        "return_logprob": True,
                        "logprob_start_len": 0,
                    },
                )
            start = time.perf_counter()
            request = urllib.request.Request(
                f"http://{host}{route}",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=120) as response:  # noqa: S310
                    answer = json.loads(response.read())
            except urllib.error.HTTPError as exc:
                code = "UNAVAILABLE" if exc.code == 503 else f"HTTP {exc.code}"
                self.ledger.fail("http", code)
                continue
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                self.ledger.fail("http", "UNAVAILABLE")  # the replica is down
                continue
            latency = (time.perf_counter() - start) * 1e3
            try:
                version, lps = parse_http(route, answer, len(seqs))
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                self.ledger.fail("http", f"unparsed answer: {type(exc).__name__}: {exc}")
                continue
            fps = [fingerprint(lp) for lp in lps]
            if len(seqs) != len(self.ledger.cases[case]):  # one sequence of the case
                fps = fps + [(b"", b"")] * (len(self.ledger.cases[case]) - len(seqs))
                self._check_first(case, fps[0], version, latency)
                continue
            self.ledger.check("http", case, fps, version, "", latency, part=0)

    def _check_first(self, case, fp, version, latency) -> None:
        """A ``/generate`` answer: the case's first sequence only."""
        ledger = self.ledger
        with ledger.lock:
            ledger.calls["http"] += 1
            ledger.tokens += len(ledger.cases[case][0])
            ledger.latency_ms["http"].append(latency)
            versions = [version] if version is not None else list(ledger.refs)
            ok = any(
                (table := ledger.refs.get(v)) is not None
                and table[case]
                and fp[0] in {h[0] for h in table[case][0]}
                for v in versions
            )
            if not ok:
                ledger.wrong.append(f"http case {case}: /generate differs from {version!r}")


def _lp(value) -> float:
    """One prompt logprob of an HTTP answer: a number, or [logprob, id, ...]; None
    (position 0, no logprob) is 0.0 as in the SDK."""
    if isinstance(value, (list, tuple)):
        value = value[0]
    return 0.0 if value is None else float(value)


def parse_http(route: str, answer: dict, count: int) -> tuple[str | None, list]:
    """(weights version or None, per-sequence logprobs) of an HTTP answer."""
    if route == "/generate":
        first = answer[0] if isinstance(answer, list) else answer
        meta = first["meta_info"]
        lps = [[_lp(v) for v in meta["input_token_logprobs"]]]
        return meta.get("weights_version") or None, lps
    choices = sorted(answer["choices"], key=lambda c: c.get("index", 0))
    if len(choices) != count:
        raise ValueError(f"{len(choices)} choices for {count} prompts")
    lps = [[_lp(v) for v in c["logprobs"]["token_logprobs"]] for c in choices]
    return (answer.get("megascore") or {}).get("weights_version") or None, lps

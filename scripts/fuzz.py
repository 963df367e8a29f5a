"""Long hostile-input run against a live megascore server (outside CI).

The long version of ``tests/reliability/test_hostile.py``, with the same strategies
(:mod:`testkit.hostile`). Starts ``megascore serve --model tiny --nproc 2
--tensor-model-parallel-size 2`` (or uses ``--target``), answers a probe request, then
sends ``--cases`` hypothesis cases, one at a time, of these kinds:

* ``unary``: mutated ScoreRequests (bad arrays, dtypes, lengths, values, options,
  strings of up to 20,000 characters) through the Score stub;
* ``wire``: garbage, truncated and corrupted bytes as a raw Score request;
* ``raw_rpc``: bytes that do not parse, sent to GetModelInfo, LoadWeights and
  Health/Check;
* ``stream``: 1-4 messages on one ScoreStream, mutated requests and unparseable bytes;
* ``load``: LoadWeights of models that cannot load;
* ``deadline``: a mutated request with a 1 ms deadline.

Every answer must be a correct result or a documented status (the checks of the CI
test); every status message at most 1,024 characters. Counts by kind and status code
are printed (and written with ``--json``). Exit 1 on any INTERNAL / UNKNOWN, hang (a
60 s deadline exceeded), wrong answer, traceback in the server log, or when the probe
is answered differently afterwards, the ranks changed or health is not SERVING.

    .venv/bin/python scripts/fuzz.py --cases 10000
    .venv/bin/python scripts/fuzz.py --cases 500 --target 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import grpc
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpc_health.v1 import health_pb2  # noqa: E402

from megascore.v1 import scoring_pb2 as pb  # noqa: E402
from megascore.v1 import scoring_pb2_grpc as pb_grpc  # noqa: E402
from megascore_server.serve_process import CPU_ONE_THREAD, SERVING, ServeProcess  # noqa: E402
from megascore_server.status import MAX_MESSAGE_CHARS  # noqa: E402
from testkit.hostile import (  # noqa: E402
    AMBIGUOUS,
    BENIGN,
    CERTAIN,
    DEADLINE_S,
    GARBAGE,
    INVALID,
    PROBE,
    UNLOADABLE_MODELS,
    UNPARSEABLE,
    check_ok,
    hostile_requests,
    same_answer,
    wire_payloads,
)
from testkit.reference import WEIGHTS  # noqa: E402

KINDS = {"unary": 50, "wire": 15, "raw_rpc": 5, "stream": 20, "load": 3, "deadline": 7}
"""Kind -> percent of the cases."""
RAW_RPCS = {  # method -> its request message
    "/megascore.v1.Scorer/GetModelInfo": pb.GetModelInfoRequest,
    "/megascore.v1.Scorer/LoadWeights": pb.LoadWeightsRequest,
    "/grpc.health.v1.Health/Check": health_pb2.HealthCheckRequest,
}
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1000, help="hypothesis cases to send")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the started server")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--target", help="use this running server instead of starting one")
    parser.add_argument("--json", help="write the summary as JSON to this file")
    return parser.parse_args(argv)


def _parses(message_type, data: bytes) -> bool:
    try:
        message_type.FromString(data)
    except Exception:
        return False
    return True


class Fuzzer:
    """Sends the cases on one channel and tallies the outcomes."""

    def __init__(self, channel: grpc.Channel):
        self.channel = channel
        self.stub = pb_grpc.ScorerStub(channel)
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.problems: list[str] = []

    def _call(self, kind: str, fn, *args, timeout: float = DEADLINE_S):
        """Runs one call: ``(code, answer or details)``; counts the code under ``kind``."""
        try:
            code, answer = grpc.StatusCode.OK, fn(*args, timeout=timeout)
        except grpc.RpcError as exc:
            code, answer = exc.code(), exc.details() or ""
        self.counts[kind][code.name] += 1
        self._expect(code not in BAD, kind, f"{code.name}: {answer}")
        hang = code is grpc.StatusCode.DEADLINE_EXCEEDED and timeout >= DEADLINE_S
        self._expect(not hang, kind, f"no answer within {timeout} s")
        if code is not grpc.StatusCode.OK:
            self._expect(len(answer) <= MAX_MESSAGE_CHARS, kind, f"{len(answer)}-char message")
        return code, answer

    def _expect(self, ok: bool, kind: str, what: str) -> None:
        if not ok:
            self.problems.append(f"{kind}: {what[:300]}")

    def _check_result(self, kind, request, code, answer, applied=frozenset()) -> None:
        if code is grpc.StatusCode.OK:
            certain = applied & set(CERTAIN) and not applied & set(AMBIGUOUS)
            self._expect(not certain, kind, f"invalid request {sorted(applied)} answered OK")
            try:
                check_ok(request, answer)
            except AssertionError as exc:
                self._expect(False, kind, f"wrong answer: {exc}")
        elif code is not grpc.StatusCode.DEADLINE_EXCEEDED or kind != "deadline":
            self._expect(code in INVALID, kind, f"{code.name} {answer}")
            benign = not applied - set(BENIGN)
            self._expect(not (applied and benign), kind, f"valid request failed: {answer}")

    def unary(self, case) -> None:
        request, applied = case
        code, answer = self._call("unary", self.stub.Score, request)
        self._check_result("unary", request, code, answer, applied)

    def deadline(self, case) -> None:
        request, applied = case
        code, answer = self._call("deadline", self.stub.Score, request, timeout=0.001)
        self._check_result("deadline", request, code, answer, applied)

    def wire(self, data: bytes) -> None:
        score = self.channel.unary_unary("/megascore.v1.Scorer/Score")
        code, answer = self._call("wire", score, data)
        if not _parses(pb.ScoreRequest, data):
            ok = code is grpc.StatusCode.INVALID_ARGUMENT and answer.startswith(UNPARSEABLE)
            self._expect(ok, "wire", f"unparseable bytes: {code.name} {answer}")
            return
        request = pb.ScoreRequest.FromString(data)
        if code is grpc.StatusCode.OK:
            answer = pb.ScoreResponse.FromString(answer)
        self._check_result("wire", request, code, answer)

    def raw_rpc(self, method: str, data: bytes) -> None:
        if _parses(RAW_RPCS[method], data):
            data = GARBAGE[len(data) % len(GARBAGE)]  # never a LoadWeights that loads
        code, answer = self._call("raw_rpc", self.channel.unary_unary(method), data)
        ok = code is grpc.StatusCode.INVALID_ARGUMENT and answer.startswith(UNPARSEABLE)
        self._expect(ok, "raw_rpc", f"{method}: {code.name} {answer}")

    def stream(self, messages: list[bytes]) -> None:
        call = self.channel.stream_stream("/megascore.v1.Scorer/ScoreStream")
        responses = []

        def run(requests, timeout):
            for raw in call(iter(requests), timeout=timeout):
                responses.append(pb.ScoreResponse.FromString(raw))

        code, answer = self._call("stream", run, messages)
        parsed = [pb.ScoreRequest.FromString(m) if m not in GARBAGE else None for m in messages]
        for request, response in zip(parsed, responses, strict=False):
            if request is None:
                self._expect(False, "stream", "a garbage message was answered")
                return
            self._check_result("stream", request, grpc.StatusCode.OK, response)
        if code is grpc.StatusCode.OK:
            self._expect(len(responses) == len(messages), "stream", "missing responses")
        else:
            self._expect(code in INVALID, "stream", f"{code.name} {answer}")
            self._expect(len(responses) < len(messages), "stream", "error after every answer")

    def load(self, model: str, version: str) -> None:
        request = pb.LoadWeightsRequest(model=model, weights_version=version)
        code, answer = self._call("load", self.stub.LoadWeights, request)
        allowed = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
        self._expect(code in allowed, "load", f"{model!r}: {code.name} {answer}")
        if code is grpc.StatusCode.FAILED_PRECONDITION:
            still = f"still serving weights {WEIGHTS!r}" in answer
            self._expect(still, "load", f"{model!r}: {answer}")


def run_cases(fuzzer: Fuzzer, cases: int, seed_value: int) -> None:
    kinds = [kind for kind, percent in KINDS.items() for _ in range(percent)]
    stream_message = st.one_of(
        hostile_requests().map(lambda case: case[0].SerializeToString()),
        st.sampled_from(GARBAGE),
    )

    @seed(seed_value)
    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # no shrinking: every case is sent once, problems recorded
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def one(data):
        kind = data.draw(st.sampled_from(kinds))
        if kind in ("unary", "deadline"):
            getattr(fuzzer, kind)(data.draw(hostile_requests()))
        elif kind == "wire":
            fuzzer.wire(data.draw(wire_payloads()))
        elif kind == "raw_rpc":
            method = data.draw(st.sampled_from(sorted(RAW_RPCS)))
            fuzzer.raw_rpc(method, data.draw(st.sampled_from(GARBAGE) | st.binary(max_size=64)))
        elif kind == "stream":
            fuzzer.stream(data.draw(st.lists(stream_message, min_size=1, max_size=4)))
        else:
            fuzzer.load(data.draw(UNLOADABLE_MODELS), data.draw(st.text(max_size=10)))

    one()


def main(argv=None) -> int:
    args = parse_args(argv)
    server = None
    if args.target is None:
        log = Path(tempfile.mkdtemp(prefix="megascore-fuzz-")) / "serve.log"
        flags = ["--model", "tiny", "--nproc", str(args.nproc), "--grace-s", "30"]
        if args.tp > 1:
            flags += ["--tensor-model-parallel-size", str(args.tp)]
        print(f"fuzz: starting megascore serve {' '.join(flags)} (log {log})", flush=True)
        server = ServeProcess(log, *flags, env=CPU_ONE_THREAD)
    problems: list[str] = []
    try:
        if server is not None:
            server.wait_serving()
            ranks = server.rank_pids()
        target = args.target or server.target
        channel = grpc.insecure_channel(target)
        fuzzer = Fuzzer(channel)
        probe = fuzzer.stub.Score(PROBE, timeout=DEADLINE_S)
        check_ok(PROBE, probe)
        start = time.monotonic()
        run_cases(fuzzer, args.cases, args.seed)
        elapsed = time.monotonic() - start
        problems += fuzzer.problems
        if not same_answer(fuzzer.stub.Score(PROBE, timeout=DEADLINE_S), probe):
            problems.append("the probe is answered differently after the run")
        if server is not None:
            if server.health() != SERVING:
                problems.append("health is not SERVING after the run")
            if not server.running() or server.rank_pids() != ranks:
                problems.append(f"ranks changed: {ranks} -> {server.rank_pids()}")
            if "Traceback (most recent call last)" in server.log_path.read_text(errors="replace"):
                problems.append(f"traceback in the server log {server.log_path}")
        counts = {kind: dict(sorted(c.items())) for kind, c in sorted(fuzzer.counts.items())}
        totals = sum((Counter(c) for c in counts.values()), Counter())
        summary = {
            "target": target,
            "cases": args.cases,
            "calls": sum(totals.values()),
            "seconds": round(elapsed, 1),
            "by_status": dict(sorted(totals.items())),
            "by_kind": counts,
            "internal_or_unknown": sum(totals[c.name] for c in BAD),
            "problems": problems[:50],
        }
        if server is not None:
            summary["server_exit_code"] = code = server.terminate(timeout=120)
            if code != 0:
                problems.append(f"server exited {code}")
    finally:
        if server is not None:
            server.close()
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    print("fuzz: " + ("PASS" if not problems else f"FAIL: {len(problems)} problem(s)"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

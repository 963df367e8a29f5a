"""The host side of ``scripts/image_check.sh``: scores through the SDK and HTTP, then drains.

Against a server in a container (``--target``): scores ``--sequences`` sequences in one
call and checks every answer (one finite, non-positive logprob per token after the
first; identical when asked twice), and the same sequences through the HTTP front
(``--http``: ``POST /v1/completions`` with ``echo``, equal to the SDK's logprobs).
Then it starts ``--in-flight`` larger calls on threads, runs ``--stop-command`` (the
engine's SIGTERM to the container) while they are in flight, and checks that each of
them completes, and that a call made after the signal is refused with UNAVAILABLE (or
finds no server). Prints one JSON line:
``{"scored": N, "http": "equal", "drained": M, "refused": "..."}``; exits 1 on a failed
check.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import shlex
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np

from megascore_client import ScoringClient, ScoringError


def _check(result, sequences) -> None:
    for seq, lp in zip(sequences, result.logprobs, strict=True):
        rest = np.asarray(lp[1:], dtype=np.float64)
        if len(lp) != len(seq) or not np.all(np.isfinite(rest)) or np.any(rest > 1e-6):
            raise SystemExit(f"image-check: bad logprobs for a {len(seq)}-token sequence: {lp}")


def _check_http(base_url: str, seqs, logprobs) -> None:
    """``/v1/completions`` (echo, max_tokens 0) answers the SDK's logprobs for ``seqs``."""
    body = {"prompt": seqs, "echo": True, "max_tokens": 0, "logprobs": 0}
    request = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        choices = json.loads(response.read())["choices"]
    for choice, want in zip(choices, logprobs, strict=True):
        got = choice["logprobs"]["token_logprobs"]
        if got[0] is not None or not np.allclose(got[1:], want[1:], rtol=0, atol=1e-6):
            raise SystemExit(f"image-check: HTTP logprobs differ from the SDK's: {got[:4]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--http", required=True, help="base URL of the HTTP front")
    p.add_argument("--stop-command", required=True)
    p.add_argument("--wait", type=float, default=300.0, help="seconds to wait for SERVING")
    args = p.parse_args()
    rng = np.random.default_rng(27)
    with ScoringClient(args.target, timeout=120.0, retries=None) as client:
        client.wait_until_serving(timeout=args.wait)
        vocab = client.model_info().vocab_size
        lengths = rng.integers(2, 200, args.sequences)
        seqs = [rng.integers(0, vocab, int(n)).tolist() for n in lengths]
        first = client.score(seqs)
        _check(first, seqs)
        again = client.score(seqs)
        pairs = zip(first.logprobs, again.logprobs, strict=True)
        if any(not np.array_equal(a, b) for a, b in pairs):
            raise SystemExit("image-check: the same sequences scored twice differ")
        _check_http(args.http, seqs, first.logprobs)

        big = [[rng.integers(0, vocab, 1024).tolist() for _ in range(16)]]
        big *= args.in_flight
        with concurrent.futures.ThreadPoolExecutor(args.in_flight) as pool:
            calls = [pool.submit(client.score, batch) for batch in big]
            time.sleep(0.2)  # the calls reach the server
            in_flight = sum(not c.done() for c in calls)
            subprocess.run(shlex.split(args.stop_command), check=True, capture_output=True)
            for call, batch in zip(calls, big, strict=True):
                _check(call.result(), batch)  # raises if the drain dropped it
        try:
            client.score(seqs[:1], timeout=10.0)
            raise SystemExit("image-check: a call after SIGTERM was served")
        except ScoringError as e:
            if e.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                raise
            refused = e.code.name
    if in_flight == 0:
        raise SystemExit("image-check: no call was in flight at SIGTERM; raise --in-flight")
    summary = {"scored": len(seqs), "http": "equal", "drained": in_flight, "refused": refused}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

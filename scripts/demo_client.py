"""Scores a sample batch against a running megascore server and prints the results.

Used by scripts/demo.sh (which passes ``--server-pid`` / ``--server-log``: if the
server process dies before it serves, this exits 1 at once with the log's tail
instead of waiting the whole ``--wait``); also a minimal example of the SDK:
    python scripts/demo_client.py --target 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque

import numpy as np

from megascore_client import ScoringClient, ScoringError
from megascore_server.procfs import alive

LOG_TAIL_LINES = 30


def log_tail(path: str | None, lines: int = LOG_TAIL_LINES) -> str:
    if not path:
        return ""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except OSError as exc:
        return f"(cannot read {path}: {exc})\n"


def fail(message: str, server_log: str | None) -> None:
    """Prints ``message`` and the server log's tail to stderr; exits 1."""
    print(f"error: {message}", file=sys.stderr)
    tail = log_tail(server_log)
    if tail:
        print(f"--- last lines of the server log {server_log} ---", file=sys.stderr)
        print(tail.rstrip("\n"), file=sys.stderr)
    sys.exit(1)


def wait_until_serving(
    client: ScoringClient,
    timeout: float,
    server_pid: int | None = None,
    server_log: str | None = None,
    interval: float = 0.25,
) -> None:
    """Polls health until SERVING; exits 1 early when the server process is gone.

    Exits 1 (with the server log's tail) when ``server_pid`` has exited, or when the
    server is not SERVING after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while True:
        if server_pid is not None and not alive(server_pid):
            fail(f"the server (pid {server_pid}) exited before serving ({last})", server_log)
        try:
            status = client.health(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            if status.serving:
                return
            last = f"health {status.status}"
        except ScoringError as exc:
            last = f"{exc.code.name}: {exc.details}"
        if time.monotonic() >= deadline:
            fail(f"{client.target} not SERVING after {timeout:.0f} s ({last})", server_log)
        time.sleep(interval)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--wait", type=float, default=300.0, help="seconds to wait for SERVING")
    parser.add_argument(
        "--server-pid", type=int, help="PID of the server: stop waiting as soon as it exits"
    )
    parser.add_argument("--server-log", help="the server's log: its tail is printed on failure")
    args = parser.parse_args()

    with ScoringClient(args.target) as client:
        wait_until_serving(client, args.wait, args.server_pid, args.server_log)
        try:
            info = client.model_info()
            print(
                f"model {info.name} ({info.architecture}): {info.num_parameters:,} parameters, "
                f"vocab {info.vocab_size}, dtype {info.dtype}, "
                f"attention {info.attention_backend}, weights {info.weights_version}"
            )
            rng = np.random.default_rng(0)
            sequences = [rng.integers(1, info.vocab_size, size=n).tolist() for n in (7, 1, 12, 4)]
            result = client.score(sequences, top_k=3, losses=("nll", "mean_nll"))
        except ScoringError as exc:
            fail(f"{exc.code.name}: {exc.details}", args.server_log)

    np.set_printoptions(precision=4, suppress=True, linewidth=120)
    for i, seq in enumerate(sequences):
        print(f"\nsequence {i}: {len(seq)} tokens")
        print(f"  token ids      {seq}")
        print(f"  logprobs       {result.logprobs[i]}")
        print(f"  top-3 ids @t=1 {result.top_k_ids[i][1] if len(seq) > 1 else '-'}")
        print(
            f"  nll {result.loss['nll'][i]:.4f} over {result.num_tokens[i]} tokens, "
            f"mean_nll {result.loss['mean_nll'][i]:.4f}"
        )
    t = result.timings
    print(
        f"\nserver: queue {t.queue_ms:.1f} ms, compute {t.compute_ms:.1f} ms, "
        f"total {t.total_ms:.1f} ms in {t.num_steps} step(s); weights {result.weights_version}"
    )
    if result.moe_metrics or result.mtp_metrics:
        print(f"moe metrics {result.moe_metrics}\nmtp metrics {result.mtp_metrics}")


if __name__ == "__main__":
    main()

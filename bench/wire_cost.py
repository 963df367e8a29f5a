"""Wire cost: encode + decode of 1M scored tokens vs the time to score them.

One round trip of the data path, without the network and without the engine,
through the code the client and the server really run (all in this process):

1. client encode: ``make_batch`` + ``build_parts`` (message-limit planning,
   ``encode_array``) + ``SerializeToString``;
2. server decode: ``ScoreRequest.FromString`` + ``validate_request``;
3. server batching: the dynamic batcher's step plan (``fill_step``, default
   16384-token budget) and ``merge_batches`` per step;
4. server encode: ``select_sequences`` per step, ``concat_outputs``,
   ``build_response`` + ``SerializeToString``;
5. client decode: ``ScoreResponse.FromString`` + ``decode_part`` + ``merge``.

The request asks for logprobs, the top-5 alternatives and the summed NLL; the
sequences follow the RL-rollout length mix (numpy arrays, as a trainer holds
them). The engine outputs of the steps are synthetic and built before timing.
The ratio divides the total by the time the engine needs for the same tokens,
extrapolated from the engine tokens/s measured in the same run.

Usage: ``python bench/wire_cost.py [--tokens N] [--repeats R] [--engine-tokens-per-s X]``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np

logger = logging.getLogger(__name__)

SERVER_BUDGET = 16384  # GrpcServerConfig.max_tokens_per_batch default
PHASES = ("client_encode", "server_decode", "server_batching", "server_encode", "client_decode")


def make_sequences(num_tokens: int, vocab_size: int, seed: int) -> list[np.ndarray]:
    """Rollout-mix sequences totalling exactly ``num_tokens`` tokens."""
    import common

    rng = np.random.default_rng(seed)
    lengths = common.rollout_lengths(
        num_tokens // 100 + 16, seed, median=common.MEDIAN, sigma=common.SIGMA
    )
    ends = np.cumsum(lengths)
    count = int(np.searchsorted(ends, num_tokens)) + 1
    lengths = lengths[:count].copy()
    lengths[-1] -= int(ends[count - 1]) - num_tokens
    if lengths[-1] <= 0:
        raise ValueError("token count split failed")
    return [rng.integers(0, vocab_size, int(n)).astype(np.int64) for n in lengths]


def _step_plan(lengths: np.ndarray, budget: int) -> list[np.ndarray]:
    """Request-sequence indices per step, as the batcher plans one lone request."""
    from megascore_server.batch_assembly import fill_step

    remaining = np.argsort(-lengths, kind="stable")
    steps = []
    while remaining.size:
        positions = fill_step([lengths[remaining]], budget)[0]
        steps.append(np.sort(remaining[positions]))
        keep = np.ones(remaining.size, dtype=bool)
        keep[positions] = False
        remaining = remaining[keep]
    return steps


def _fake_output(step, top_k: int, rng: np.random.Generator):
    from megascore.api.types import ScoreOutput

    t, b = step.num_tokens, step.num_sequences
    values = {
        "logprobs": -rng.exponential(2.0, t).astype(np.float32),
        "top_k_ids": rng.integers(0, 32000, (t, top_k)),
        "top_k_logprobs": -rng.exponential(2.0, (t, top_k)).astype(np.float32),
        "losses": {"nll": rng.random(b) * 100.0},
        "num_loss_tokens": step.lengths - 1,
        "cached_tokens": np.zeros(b, np.int64),
    }
    return ScoreOutput(values=values, weights_version="builtin:bench@1234")


def round_trip(sequences: list[np.ndarray], vocab_size: int, top_k: int = 5) -> dict[str, float]:
    """One timed round trip; returns seconds per phase (see the module docstring)."""
    from megascore.api.limits import Limits
    from megascore.api.selection import concat_outputs, select_sequences
    from megascore.v1 import scoring_pb2 as pb
    from megascore_client.channel import DEFAULT_MAX_MESSAGE_BYTES
    from megascore_client.inputs import make_batch
    from megascore_client.splitting import ScoreOptions, build_parts, decode_part, merge
    from megascore_server.batch_assembly import merge_batches
    from megascore_server.convert import build_response
    from megascore_server.validation import validate_request

    limits = Limits(
        vocab_size=vocab_size,
        max_sequence_length=4096,
        max_request_tokens=1 << 20,
        max_top_k=64,
        loss_names=("nll", "mean_nll"),
    )
    rng = np.random.default_rng(0)
    times = {}

    start = time.perf_counter()
    options = ScoreOptions(top_k=top_k, losses=("nll",))
    parts = build_parts(
        make_batch(sequences),
        options,
        "bench",
        max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES,
        max_request_tokens=limits.max_request_tokens,
    )
    requests = [part.request.SerializeToString() for part in parts]
    times["client_encode"] = time.perf_counter() - start

    start = time.perf_counter()
    batches = [validate_request(pb.ScoreRequest.FromString(data), limits) for data in requests]
    times["server_decode"] = time.perf_counter() - start

    start = time.perf_counter()
    plans = []
    for batch in batches:
        steps = _step_plan(batch.lengths, SERVER_BUDGET)
        plans.append([(idx, merge_batches([(batch, idx)])) for idx in steps])
    times["server_batching"] = time.perf_counter() - start

    outputs = [[_fake_output(step, top_k, rng) for _, step in plan] for plan in plans]
    start = time.perf_counter()
    responses = []
    for batch, plan, outs in zip(batches, plans, outputs, strict=True):
        pieces = []
        for (idx, step), out in zip(plan, outs, strict=True):
            part = select_sequences(out, step.lengths, np.arange(idx.size), batch)
            pieces.append((idx, part))
        output = concat_outputs(pieces, batch.lengths)
        response = build_response("bench", batch, output, pb.Timings(num_steps=len(plan)))
        responses.append(response.SerializeToString())
    times["server_encode"] = time.perf_counter() - start

    start = time.perf_counter()
    results = [
        decode_part(pb.ScoreResponse.FromString(data), part)
        for data, part in zip(responses, parts, strict=True)
    ]
    result = merge(results, "bench")
    times["client_decode"] = time.perf_counter() - start

    assert len(result.logprobs) == len(sequences)
    times["request_mb"] = sum(len(r) for r in requests) / 1e6
    times["response_mb"] = sum(len(r) for r in responses) / 1e6
    times["requests"] = len(requests)
    return times


def measure(num_tokens: int, repeats: int, vocab_size: int = 32000, seed: int = 0) -> dict:
    """Median seconds per phase over ``repeats`` round trips (after one warm-up).

    Returns:
        ``{phase: seconds, "total": seconds, "request_mb", "response_mb", "requests"}``.
    """
    sequences = make_sequences(num_tokens, vocab_size, seed)
    round_trip(sequences, vocab_size)  # warm-up
    runs = [round_trip(sequences, vocab_size) for _ in range(repeats)]
    out = {phase: statistics.median(r[phase] for r in runs) for phase in PHASES}
    out["total"] = statistics.median(sum(r[p] for p in PHASES) for r in runs)
    for key in ("request_mb", "response_mb", "requests"):
        out[key] = runs[0][key]
    out["sequences"] = len(sequences)
    return out


def explain(res: dict) -> str:
    """Which phase dominates."""
    total = res["total"]
    parts = sorted(PHASES, key=lambda p: -res[p])
    shares = ", ".join(f"{p.replace('_', ' ')} {res[p] / total:.0%}" for p in parts)
    return (
        f"{total * 1e3:.0f} ms for {res['sequences']} sequences: {shares}. The response "
        f"({res['response_mb']:.0f} MB: float32 logprobs, int64 top-k ids, float32 top-k "
        f"logprobs) is {res['response_mb'] / max(res['request_mb'], 1e-9):.0f}x the request; "
        f"every copy of it costs (profile below)."
    )


def profile(num_tokens: int, vocab_size: int = 32000, seed: int = 0) -> str:
    """cProfile top functions of one round trip."""
    import common

    sequences = make_sequences(num_tokens, vocab_size, seed)
    return common.python_profile(lambda: round_trip(sequences, vocab_size))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engine-tokens-per-s", type=float, default=None, help="to print the ratio")
    args = p.parse_args()
    res = measure(args.tokens, args.repeats)
    for phase in PHASES:
        print(f"{phase:16} {res[phase] * 1e3:9.1f} ms")
    print(
        f"{'total':16} {res['total'] * 1e3:9.1f} ms  ({res['sequences']} sequences, "
        f"request {res['request_mb']:.1f} MB, response {res['response_mb']:.1f} MB)"
    )
    if args.engine_tokens_per_s:
        scoring = args.tokens / args.engine_tokens_per_s
        print(f"scoring {scoring:.1f} s -> wire / scoring = {res['total'] / scoring:.4f}")


if __name__ == "__main__":
    main()

"""Issue 7 (CI-short): concurrent mixed clients against the shared ``--nproc 2`` TP=2 server.

Sync unary, sync streaming and asyncio clients score random batches for ~20 s while
the dynamic batcher merges their requests into shared engine steps. Every answer must
match the same batch scored alone by a single client beforehand bit for bit (the
engine is batch-invariant on the CPU, docs/engine.md); no call may fail; the server's
resident memory (launcher + both ranks) may not grow by 10 % or more after warm-up.
``scripts/soak.py`` is the long version.
"""

from __future__ import annotations

import pytest

from megascore_client import ScoringClient
from testkit.load import RssSampler, make_cases, reference_results, run_load

CLIENTS = {"unary": 2, "stream": 2, "async": 2}
WARMUP_S = 5.0
DURATION_S = 20.0
TOLERANCE = 0.0  # bit-identical


@pytest.mark.timeout(900)
def test_concurrent_mixed_clients_match_the_reference_no_failures(tp2, capsys):
    cases = make_cases(24, seed=1)
    with ScoringClient(tp2.target, timeout=120) as client:
        refs = reference_results(client, cases)

    warmup = run_load(
        tp2.target, cases, refs, duration_s=WARMUP_S, clients=CLIENTS, tolerance=TOLERANCE
    )
    assert not warmup.failures, warmup.failures[:5]
    rss_start = tp2.total_rss_kb()
    sampler = RssSampler(tp2.total_rss_kb)
    stats = run_load(
        tp2.target, cases, refs, duration_s=DURATION_S, clients=CLIENTS, tolerance=TOLERANCE
    )
    samples = sampler.stop()
    rss_end = tp2.total_rss_kb()

    with capsys.disabled():
        print(
            f"\n[load] {stats.count} calls, {stats.tokens} tokens in {DURATION_S:.0f} s "
            f"({stats.count / DURATION_S:.1f} calls/s, {stats.tokens / DURATION_S:.0f} tokens/s)"
        )
        for kind in CLIENTS:
            p = stats.percentiles(kind)
            print(
                f"[load] {kind:6s} n={len(stats.latencies_ms[kind]):4d} "
                + " ".join(f"{k}={v:.1f}ms" for k, v in p.items())
            )
        print(
            f"[load] max diff from reference {stats.max_diff}; RSS {rss_start} -> {rss_end} KiB "
            f"(peak {max(rss for _, rss in samples)} KiB)"
        )
    assert not stats.failures, stats.failures[:5]
    assert not stats.mismatches, stats.mismatches[:5]
    assert all(stats.latencies_ms[kind] for kind in CLIENTS), "a client kind never completed"
    assert stats.count >= 30, f"only {stats.count} calls in {DURATION_S} s"
    assert rss_end < rss_start * 1.10, f"RSS grew from {rss_start} to {rss_end} KiB"
    assert tp2.running()

"""AsyncScoringClient and its streaming helper (grpc.aio) against a real server."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from megascore_client import AsyncScoringClient, InvalidInputError, RetryPolicy, ScoringError
from tests.client.fake_server import (
    VOCAB,
    FakeScorer,
    FakeServer,
    ref_logprobs,
    ref_moe,
    ref_nll,
    ref_top_k,
)


def _seqs(seed: int, count: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=int(n)) for n in rng.integers(2, 60, size=count)]


def test_many_concurrent_score_calls(server):
    server.scorer.delay_s = 0.2
    batches = [_seqs(i) for i in range(40)]

    async def main():
        async with AsyncScoringClient(server.target, timeout=20) as client:
            start = time.perf_counter()
            results = await asyncio.gather(
                *(client.score(b, top_k=2, request_id=f"c{i}") for i, b in enumerate(batches))
            )
            return results, time.perf_counter() - start

    results, elapsed = asyncio.run(main())
    assert elapsed < 40 * 0.2 / 2  # served concurrently, not one after the other
    for i, (batch, result) in enumerate(zip(batches, results, strict=True)):
        assert result.request_id == f"c{i}"
        for seq, got, top in zip(batch, result.logprobs, result.top_k_ids, strict=True):
            np.testing.assert_array_equal(got, ref_logprobs(seq))
            np.testing.assert_array_equal(top, ref_top_k(seq, 2)[0])
    assert server.scorer.calls["Score"] == 40 and server.scorer.calls["GetModelInfo"] == 1


def test_async_split_batch_and_options():
    limit = 64 * 1024
    seqs = _seqs(7, 400)
    masks = [np.arange(len(s)) % 2 for s in seqs]

    async def main(target):
        async with AsyncScoringClient(target, max_message_bytes=limit, max_concurrency=2) as c:
            return await c.score(seqs, loss_mask=masks, top_k=3, metrics=("moe",), temperature=3)

    with FakeServer(FakeScorer(), max_message_bytes=limit) as srv:
        result = asyncio.run(main(srv.target))
        assert result.timings.num_requests == len(srv.scorer.requests) > 1
    np.testing.assert_allclose(
        result.loss["nll"], [ref_nll(s, m, 3.0) for s, m in zip(seqs, masks, strict=True)]
    )
    np.testing.assert_array_equal(result.logprobs[-1], ref_logprobs(seqs[-1], 3.0))
    assert result.moe_metrics == pytest.approx(ref_moe(np.concatenate(seqs)))


def test_async_errors_health_info_weights(server):
    async def main():
        async with AsyncScoringClient(
            server.target, token="tok", retries=RetryPolicy(3, 0.01, 0.02)
        ) as client:
            assert (await client.health()).serving
            assert (await client.health("nope")).status == "SERVICE_UNKNOWN"
            assert (await client.wait_until_serving(timeout=5)).status == "SERVING"
            assert (await client.model_info()).max_top_k == 8
            loaded = await client.load_weights("megatron:/ckpt", "w2")
            assert loaded.previous_weights_version == "v0"
            assert (await client.score([[1, 2]])).weights_version == "w2"
            with pytest.raises(ScoringError) as info:
                await client.score([[1, VOCAB]])
            assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(InvalidInputError):
                await client.score([[1, 2]], temperature=-1)
            server.scorer.fail_next.append((grpc.StatusCode.UNAVAILABLE, "restarting"))
            assert (await client.score([[3, 4]])).lengths.tolist() == [2]

    asyncio.run(main())
    assert all(md.get("authorization") == "Bearer tok" for md in server.scorer.metadata)


def test_async_stream_in_order(server):
    batches = [_seqs(100 + i, 3) for i in range(15)]

    async def main():
        async with AsyncScoringClient(server.target) as client:
            async with client.stream() as stream:
                futures = [
                    await stream.submit(b, request_id=f"s{i}", losses=("nll", "mean_nll"))
                    for i, b in enumerate(batches)
                ]
                results = await asyncio.gather(*futures)
            with pytest.raises(RuntimeError):
                await stream.submit(batches[0])
            return results

    results = asyncio.run(main())
    for i, (batch, result) in enumerate(zip(batches, results, strict=True)):
        assert result.request_id == f"s{i}" and set(result.loss) == {"nll", "mean_nll"}
        np.testing.assert_array_equal(result.logprobs[0], ref_logprobs(batch[0]))
    assert server.scorer.calls["ScoreStream"] == 1
    assert [r["request_id"] for r in server.scorer.requests] == [f"s{i}" for i in range(15)]


def test_async_stream_concurrent_submitters_and_failure(server):
    async def main():
        async with AsyncScoringClient(server.target) as client:
            async with client.stream() as stream:

                async def worker(w):
                    out = []
                    for j in range(5):
                        fut = await stream.submit([[w, j, w + j]], request_id=f"w{w}-{j}")
                        out.append(await fut)
                    return out

                per_worker = await asyncio.gather(*(worker(w) for w in range(6)))
                assert [r.request_id for r in per_worker[2]] == [f"w2-{j}" for j in range(5)]
                bad = await stream.submit([[1, VOCAB + 3]])
                with pytest.raises(ScoringError) as info:
                    await bad
                assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
                await asyncio.sleep(0.05)
                with pytest.raises(ScoringError):
                    await stream.submit([[1, 2]])

    asyncio.run(main())
    assert server.scorer.calls["ScoreStream"] == 1

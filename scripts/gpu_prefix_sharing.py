"""The shared-prefix and prefix-cache rows of the GPU check (``scripts/gpu_check.py``).

Two in-process engines on one device, the ``torch`` attention backend: dense
(``prefix_sharing=False``) and shared (``prefix_sharing=True``, the continuations'
attention through ``megascore.model.sdpa.attention_with_lse``). A GRPO batch (4
prompts x n = 8, prompts of 512 tokens, responses of 256) is scored by both:

* parity: float32, max |shared - dense| logprob <= 1e-4; bfloat16 (two kernels round
  differently), the mean <= ``BF16_MEAN``;
* speed: dense-equivalent tokens/s of each, their ratio beside the ideal one (the
  batch's dense tokens over the rows the shared step computes).
"""

from __future__ import annotations

import time

import numpy as np

FP32_MAX, BF16_MEAN = 1e-4, 0.02
PROMPTS, N, PROMPT_LEN, RESPONSE_LEN = 4, 8, 512, 256


def grpo_batch(vocab_size: int):
    """The GRPO batch: ``PROMPTS`` prompts, ``N`` responses each, in shuffled order."""
    from megascore.api.types import ScoreBatch

    rng = np.random.default_rng(0)
    seqs = []
    for _ in range(PROMPTS):
        prompt = rng.integers(1, vocab_size, PROMPT_LEN)
        seqs += [
            np.concatenate([prompt, rng.integers(1, vocab_size, RESPONSE_LEN)]) for _ in range(N)
        ]
    seqs = [seqs[i] for i in rng.permutation(len(seqs))]
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    return ScoreBatch(token_ids=np.concatenate(seqs), lengths=lengths, return_logprobs=True)


def _engine(model: str, device: str, dtype: str, sharing: bool):
    from megascore.config import EngineConfig
    from megascore.engine.runtime import DistributedEngine

    cfg = EngineConfig(
        model=model,
        device=device,
        dtype=dtype,
        attention_backend="torch",
        prefix_sharing=sharing,
        prefix_cache=False,  # nothing kept between the warm-up and the timed call
        min_shared_prefix=16,
    )
    return DistributedEngine.create(cfg)


def _timed(engine, batch) -> tuple[float, np.ndarray]:
    import torch

    engine.score(batch)  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = engine.score(batch)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, np.asarray(out.logprobs, dtype=np.float64)


def computed_rows(batch, min_shared: int = 16) -> int:
    """Rows the shared step computes (its segments)."""
    from megascore.engine.layout.prefix_tree import shared_layout

    layout = shared_layout(batch.token_ids, batch.lengths, min_shared=min_shared)
    return int(layout.lengths.sum())


def prefix_sharing(model: str, device: str, dtype: str) -> tuple[str, str]:
    """Shared vs dense on ``model``: parity and the speed ratio against its ideal."""
    results = {}
    batch = None
    for sharing in (False, True):
        engine = _engine(model, device, dtype, sharing)
        try:
            if sharing and not engine.min_shared_prefix:
                return "FAIL", "the shared engine runs dense (min_shared_prefix 0)"
            batch = batch or grpo_batch(engine.info().vocab_size)
            results[sharing] = _timed(engine, batch)
        finally:
            engine.shutdown()
    (dense_s, dense_lp), (shared_s, shared_lp) = results[False], results[True]
    dev = np.abs(shared_lp - dense_lp)
    if dtype == "float32":
        diff, tol, what = float(dev.max()), FP32_MAX, "max"
    else:
        diff, tol, what = float(dev.mean()), BF16_MEAN, "mean"
    tokens = batch.num_tokens
    ideal = tokens / computed_rows(batch)
    detail = (
        f"{what} |shared - dense| logprob {diff:.2e} (tol {tol:.0e}, max {dev.max():.2e}); "
        f"dense {tokens / dense_s:,.0f} / shared {tokens / shared_s:,.0f} dense-equivalent "
        f"tokens/s = {dense_s / shared_s:.2f}x (ideal {ideal:.2f}x: {tokens} dense tokens, "
        f"{computed_rows(batch)} computed); {dtype}, torch backend"
    )
    return ("PASS" if diff <= tol else "FAIL"), detail


CACHE_TRAJECTORIES, CACHE_TURNS, SYSTEM_LEN, TURN_LEN = 4, 4, 512, 128


def trajectories(vocab_size: int) -> list:
    """Turn-by-turn requests: ``CACHE_TRAJECTORIES`` histories sharing a system prompt,
    each turn the whole history with ``score_from`` at the turn, interleaved."""
    from megascore.api.types import ScoreBatch

    rng = np.random.default_rng(1)
    system = rng.integers(1, vocab_size, SYSTEM_LEN)
    histories = [system] * CACHE_TRAJECTORIES
    requests = []
    for _ in range(CACHE_TURNS):
        for t in range(CACHE_TRAJECTORIES):
            start = len(histories[t])
            histories[t] = np.concatenate([histories[t], rng.integers(1, vocab_size, TURN_LEN)])
            requests.append(
                ScoreBatch(
                    token_ids=histories[t],
                    lengths=np.array([len(histories[t])]),
                    score_from=np.array([start]),
                )
            )
    return requests


def prefix_cache(model: str, device: str, dtype: str) -> tuple[str, str]:
    """The prefix cache (``prefix_cache=True``) vs none (``prefix_cache=False``: on CUDA the
    plain attention) on turn-by-turn requests, and the cache again with a device tier of
    a quarter of what the first held and a host tier behind it (pinned host memory on
    CUDA): parity of the logprobs from each turn on, tokens/s of each, the budgets and
    what each held and moved."""
    results, requests, held = {}, None, 0
    for name in ("none", "cache", "tiers"):
        cfg = dict(prefix_cache=name != "none")
        if name == "tiers":  # a quarter of what the cache held on the device, 2x behind
            cfg.update(prefix_cache_gib=held / 4 / 2**30, prefix_cache_host_gib=2 * held / 2**30)
        requests, results[name] = _cache_run(model, device, dtype, cfg, requests)
        held = results[name][3]["stored_bytes"] if results[name][3] else 0
    off_s, off_out, _, _ = results["none"]
    if results["cache"][3] is None or results["tiers"][3] is None:
        return "FAIL", "the cache engine runs no prefix cache"
    tol = FP32_MAX if dtype == "float32" else 10 * BF16_MEAN
    tokens = sum(r.num_tokens for r in requests[1:])
    parts, passed = [], True
    for name in ("cache", "tiers"):
        on_s, on_out, budget, stats = results[name]
        dev = max(
            float(np.abs(np.asarray(a.logprobs[r.score_from[0]:], np.float64)
                         - np.asarray(b.logprobs[r.score_from[0]:], np.float64)).max())
            for a, b, r in zip(on_out, off_out, requests[1:], strict=True)
        )  # fmt: skip
        cached = sum(int(o.cached_tokens.sum()) for o in on_out)
        passed &= dev <= tol and cached > 0
        parts.append(
            f"{name}: max |cache - none| logprob {dev:.2e} (tol {tol:.0e}); {tokens / on_s:,.0f}"
            f" dense-equivalent tokens/s = {off_s / on_s:.2f}x ({cached} of {tokens} tokens "
            f"read from the cache); budget {budget[0] / 2**20:.1f} MiB on the device, "
            f"{budget[1] / 2**20:.1f} MiB host tier; {stats['stored_bytes'] / 2**20:.1f} MiB "
            f"held in {stats['blocks']} blocks, {stats['evictions']} evicted, "
            f"{stats['demotions']} moved to the host and {stats['promotions']} back"
        )
    passed &= results["tiers"][3]["promotions"] > 0
    detail = f"none {tokens / off_s:,.0f} tokens/s; " + "; ".join(parts)
    return ("PASS" if passed else "FAIL"), f"{detail}; {dtype}, torch backend"


def _cache_run(model, device, dtype, cfg: dict, requests):
    """``(requests, (seconds, outputs, (device, host) budget bytes, final stats))`` of one
    engine over the turn-by-turn requests (the first, a warm-up, untimed)."""
    import torch

    from megascore.config import EngineConfig
    from megascore.engine.runtime import DistributedEngine

    engine = DistributedEngine.create(
        EngineConfig(model=model, device=device, dtype=dtype, attention_backend="torch", **cfg)
    )
    try:
        requests = requests or trajectories(engine.info().vocab_size)
        engine.score(requests[0])  # warm-up (its own cache entries are kept)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = [engine.score(r) for r in requests[1:]]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        index = engine._cache.index if engine._cache is not None else None
        budget = (0, 0) if index is None else (
            index.budget_bytes, index.host_slots * index.slot_bytes
        )  # fmt: skip
        return requests, (seconds, outs, budget, engine.prefix_cache_stats())
    finally:
        engine.shutdown()

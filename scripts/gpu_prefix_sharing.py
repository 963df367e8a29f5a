"""The shared-prefix rows of the GPU check (``scripts/gpu_check.py``).

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

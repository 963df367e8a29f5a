"""Shared pieces of the engine test scripts: the edge-case batch, result files, checks
that a failure injected on one rank fails the call everywhere.

Imported by the scripts here (run under torchrun from tests/distributed/) and by
tests/distributed/test_engine_parity.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from megascore.api import layout, schema
from megascore.api.errors import WorkerLostError
from megascore.api.types import ScoreBatch, ScoreOutput
from megascore.config import EngineConfig

# Edge cases: length-1 sequences, one at the tiny models' max length (1024), one long
# and many short ones. Every layout also returns the entropy, the logprobs of
# TARGET_IDS caller-chosen ids per token and the rollout-mismatch statistics (issue 22).
LENGTHS = (1, 5, 1024, 1, 17, 3, 2, 40, 1, 9, 2)
# Many sequences of similar lengths: the pipeline step splits into several microbatches.
PP_LENGTHS = (1, 5, 60, 1, 17, 3, 2, 40, 1, 9, 2, 33, 64, 20, 7, 50)
TOP_K = 8
TARGET_IDS = 6
VOCAB = 512


def edge_case_batch(
    *, seed: int = 0, moe: bool = False, lengths: tuple[int, ...] = LENGTHS
) -> ScoreBatch:
    """The batch every layout scores (deterministic)."""
    rng = np.random.default_rng(seed)
    lens = np.array(lengths, dtype=np.int64)
    total = int(lens.sum())
    return ScoreBatch(
        token_ids=rng.integers(0, VOCAB, total).astype(np.int64),
        lengths=lens,
        loss_mask=(rng.random(total) < 0.8).astype(np.uint8),
        temperature=rng.uniform(0.5, 1.5, len(lens)).astype(np.float32),
        top_k=TOP_K,
        losses=("mean_nll", "nll", "perplexity"),
        return_logprobs=True,
        return_moe_metrics=moe,
        return_mtp_metrics=moe,
        return_entropy=True,
        target_ids=rng.integers(0, VOCAB, (total, TARGET_IDS)),
        rollout_logprobs=rng.normal(-6.0, 1.0, total),
    )


def pp_batch(moe: bool = False) -> ScoreBatch:
    """The batch every pipeline layout scores."""
    return edge_case_batch(moe=moe, lengths=PP_LENGTHS)


def save_output(path: Path, out: ScoreOutput, **extra) -> None:
    """Writes a ScoreOutput (and scalars) to ``path`` (.npz) plus metrics to ``path``.json."""
    arrays = {
        "logprobs": out.logprobs,
        "top_k_ids": out.top_k_ids,
        "top_k_logprobs": out.top_k_logprobs,
        "num_loss_tokens": out.num_loss_tokens,
        "entropy": out.entropy,
        "target_logprobs": out.target_logprobs,
    }
    arrays.update({f"loss_{k}": v for k, v in out.losses.items()})
    arrays.update({f"mismatch_{k}": v for k, v in out.mismatch.items()})
    np.savez(path.with_suffix(".npz"), **{k: v for k, v in arrays.items() if v is not None})
    meta = {
        "moe_metrics": out.moe_metrics,
        "mtp_metrics": out.mtp_metrics,
        "weights_version": out.weights_version,
        **extra,
    }
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1, sort_keys=True))


def load_output(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """Reads what :func:`save_output` wrote."""
    with np.load(path.with_suffix(".npz")) as data:
        arrays = {k: data[k] for k in data.files}
    return arrays, json.loads(path.with_suffix(".json").read_text())


class CheckLog:
    """Records named checks as "ok" or a traceback, written to a JSON file."""

    def __init__(self, path: Path):
        self.path = path
        self.results: dict[str, str] = {}

    def run(self, name: str, fn, *args) -> None:
        try:
            fn(*args)
            self.results[name] = "ok"
        except Exception:
            self.results[name] = traceback.format_exc()
        self.write()

    def write(self) -> None:
        self.path.write_text(json.dumps(self.results, indent=1, sort_keys=True))


def expect_worker_lost(fn, match: str) -> float:
    """Runs ``fn``, which must raise WorkerLostError mentioning ``match``; returns seconds."""
    start = time.monotonic()
    try:
        fn()
    except WorkerLostError as e:
        assert match in str(e), f"WorkerLostError {e!r} does not mention {match!r}"
        return time.monotonic() - start
    raise AssertionError("expected WorkerLostError")


def raise_after(real):
    """``real``, then a RuntimeError: a rank that fails after its collectives."""

    def failing(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("injected failure")

    return failing


def stall_before(real, seconds: float):
    """``real`` after ``seconds`` of sleep: a rank that hangs."""

    def stalled(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    return stalled


def expect_injected_failure(
    engine, rank: int, module, target: str, replacement, *, on_rank: int, batch, match: str
) -> float:
    """Replaces ``module.target`` on rank ``on_rank`` for one step: rank 0's call on
    ``batch`` fails naming ``match`` and the next one finds the replica broken; the
    other ranks' worker loops fail naming ``match`` too. Restores the target and shuts
    the engine down.

    Returns:
        Rank 0's seconds to the first failure (0.0 on the other ranks).
    """
    real = getattr(module, target)
    if rank == on_rank:
        setattr(module, target, replacement)
    elapsed = 0.0
    try:
        if rank == 0:
            elapsed = expect_worker_lost(lambda: engine.score(batch), match)
            expect_worker_lost(lambda: engine.score(batch), "broken")
        else:
            expect_worker_lost(engine.worker_loop, match)
    finally:
        setattr(module, target, real)
        engine.shutdown()  # rank 0: broken, so no SHUTDOWN broadcast; all: local teardown
    return elapsed


def layout_config(model, tp, cp, ep, *, pad=1, timeout=60.0, **kwargs) -> EngineConfig:
    """The engine config of one test layout (``kwargs``: the other EngineConfig fields)."""
    return EngineConfig(
        pad_to_multiple_of=pad,
        model=model,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        collective_timeout_s=timeout,
        **kwargs,
    )


def exit_without_teardown() -> None:
    """Leaves at once: after a timed-out or hung rank the process group is unusable."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


MASKED_OUTPUTS = ("logprobs", "top_k_ids", "top_k_logprobs", "entropy", "target_logprobs")
"""The per-token head outputs of :func:`save_output`, those ``logprob_positions`` masks."""


def assert_masked_match(masked: dict, dense: dict, batch: ScoreBatch, atol: float) -> None:
    """``logprob_positions`` masked (``masked``, arrays of :func:`load_output`) against the
    dense output of the same batch: equal within ``atol`` at the loss mask's positions,
    each output's fill elsewhere; the losses and counts the same."""
    inside = layout.effective_loss_mask(batch.lengths, batch.loss_mask) == 1
    assert 0 < inside.sum() < batch.num_tokens
    for name in MASKED_OUTPUTS:
        got, want = masked[name], dense[name]
        np.testing.assert_allclose(got[inside], want[inside], rtol=0, atol=atol, err_msg=name)
        assert (got[~inside] == schema.output(name).fill).all(), name
    for name in (k for k in dense if k.startswith(("loss_", "mismatch_"))):
        np.testing.assert_allclose(masked[name], dense[name], rtol=1e-5, atol=atol, err_msg=name)
    np.testing.assert_array_equal(masked["num_loss_tokens"], dense["num_loss_tokens"])

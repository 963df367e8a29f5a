"""Shared pieces of the engine test scripts: the edge-case batch and result files.

Imported by ``engine_single.py`` and ``engine_layouts.py`` (run under torchrun
from tests/distributed/test_engine_parity.py) and by that test.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import numpy as np

from megascore.types import ScoreBatch, ScoreOutput

# Edge cases: length-1 sequences, one at the tiny models' max length (1024), one long
# and many short ones.
LENGTHS = (1, 5, 1024, 1, 17, 3, 2, 40, 1, 9, 2)
TOP_K = 8
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
        want_logprobs=True,
        want_moe_metrics=moe,
        want_mtp_metrics=moe,
    )


def save_output(path: Path, out: ScoreOutput, **extra) -> None:
    """Writes a ScoreOutput (and scalars) to ``path`` (.npz) plus metrics to ``path``.json."""
    arrays = {
        "logprobs": out.logprobs,
        "top_k_ids": out.top_k_ids,
        "top_k_logprobs": out.top_k_logprobs,
        "num_loss_tokens": out.num_loss_tokens,
    }
    arrays.update({f"loss_{k}": v for k, v in out.losses.items()})
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

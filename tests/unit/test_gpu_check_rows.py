"""The single-GPU rows of scripts/gpu_check.py run on the CPU (small shapes, float32): a
GPU run only adds the device. Each row passes here, and its detail shows what it
compared (a row that compared nothing would pass too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.one_rank import one_rank_world

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def ctx(tmp_path, monkeypatch):
    """A row context on the CPU, the scripts importable, a one-rank world."""
    from megascore_server.ports import pick_port

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_PORT", str(pick_port()))
    import gpu_check

    with one_rank_world():
        yield gpu_check.RowContext("cpu", tmp_path, 60.0)


@pytest.mark.parametrize(
    ("row", "shows"),
    [
        ("parity", r"vocab 128256: float32 \(torch\): max .* top-256 sets ([1-9]\d*)/\1$"),
        ("mla", r"deepseek_v3-qfull float32 \(torch\): max .*; deepseek_v3 float32"),
        ("fp8", r"FP8 blocks dequantised at load; deepseek_v3 float32"),
        ("top_k", r"16/16 rows equal the exact order; [1-9]\d* rows tied at the boundary"),
        ("lm_head", r"bf16 head \S+, fp32 head \S+ \(bf16 body, cpu\)"),
        ("attention_lse", r"float32 \S+ \(tol 2e-05\), float32 \S+ \(tol 2e-05\)$"),
        ("memory", r"^12 steps; after step 1: resident grew by"),
    ],
)
def test_single_gpu_row_passes_on_the_cpu(ctx, row, shows):
    import re

    import gpu_check_single

    result, detail = getattr(gpu_check_single, row)(ctx)
    assert result == "PASS", detail
    assert re.search(shows, detail), detail

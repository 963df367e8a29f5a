"""LoRA adapters at TP=2 (llama; qwen3_moe with sequence parallelism), EP=2, CP=2 and
PP=2 (one 2-rank torchrun launch of ``scripts/lora_worker.py``) = the same adapters at TP=1
(float32 rounding) = transformers + peft (1e-4).

The batch is ``token_batch()`` with its three sequences under
``[first adapter, base, second adapter]`` of the family (``lora_worker.ADAPTERS``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megascore.checkpoint import resolve_model
from megascore.checkpoint.lora_weights import load_adapter
from megascore.config import EngineConfig
from megascore.model.batch_invariant import make_batch_invariant
from megascore.model.build import build_model
from testkit.checkpoints import token_batch
from tests.checkpoint.lora_cases import logprobs, packed_logits, write_adapter
from tests.checkpoint.scripts.lora_worker import ADAPTERS, LAYOUTS
from tests.checkpoint.test_lora import PARITY
from tests.torchrun import run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "lora_worker.py"
TOL = 1e-4  # vs transformers + peft
LAYOUT_TOL = 1e-5  # vs TP=1: same weights, other reduction order


@pytest.fixture(scope="module")
def outcome(hf_dirs, pgs, tmp_path_factory):
    """(out dir, family -> TP=1 logprobs, family -> peft references, launch error)."""
    work = tmp_path_factory.mktemp("lora_layouts")
    ids, tp1, refs = token_batch(), {}, {}
    for family, cases in ADAPTERS.items():
        (work / f"hf_{family}").symlink_to(hf_dirs[family])
        cfg, load, _ = resolve_model(f"hf:{hf_dirs[family]}")
        model = build_model(cfg, EngineConfig(device="cpu"), pgs, random_weights=False)
        make_batch_invariant(model)
        load(model)
        slots = []
        for case in cases:
            ref, base = write_adapter(family, work / f"ad_{case}", ids, **PARITY[case][1])
            refs.setdefault(family, []).append(ref)
            slots.append(load_adapter(model, cfg, case, work / f"ad_{case}"))
        refs[family].insert(1, base)
        seqs = list(ids)
        tp1[family] = logprobs(packed_logits(model, pgs, seqs, [slots[0], -1, slots[1]]), seqs)
    out = work / "out"
    out.mkdir()
    try:
        error = None
        run_torchrun(SCRIPT, 2, str(work), str(out), timeout=580)
    except AssertionError as e:
        error = str(e)
    return out, tp1, refs, error


CASES = [(layout, family) for layout, (_, families) in LAYOUTS.items() for family in families]


@pytest.mark.parametrize(("layout", "family"), CASES)
def test_adapters_in_a_parallel_layout_match_tp1_and_peft(outcome, layout, family):
    out, tp1, refs, error = outcome
    path = out / f"{layout}_{family}.npy"
    if not path.exists():
        errors = "\n".join(p.read_text() for p in out.glob(f"{layout}_{family}.rank*.error"))
        pytest.fail(f"{layout} {family}: no result\n{errors or error}")
    got = np.load(path)
    assert np.abs(got - tp1[family]).max() <= LAYOUT_TOL
    for row, ref in enumerate(refs[family]):  # [first adapter, base, second adapter]
        assert np.abs(got[row] - ref[row]).max() <= TOL, f"sequence {row}"

"""Served LoRA adapters through ``DistributedEngine`` at TP2, PP2 (2 microbatches) and EP2
(issue 46's adapter parity): one 2-rank torchrun launch of
``scripts/adapter_engine_layouts.py`` starts an engine per layout and family with the
family's peft adapters (``EngineConfig.adapters``); a request naming an adapter, or the
base, = transformers + peft on the same weights (<= 1e-4, fp32) on the Llama, Qwen3 and
Qwen3-MoE ``hf:`` checkpoints (r = 8 and 16, rsLoRA on and off, q/k/v/o + gate/up/down;
attention only on the MoE, whose experts are refused); on llama a step of five
sequences under four adapters and the base = each alone, bit for bit, in every layout.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from testkit.checkpoints import token_batch
from tests.checkpoint.lora_cases import write_adapter
from tests.checkpoint.scripts.adapter_engine_layouts import CASES, checks
from tests.checkpoint.test_lora import PARITY
from tests.torchrun import run_check_script

SCRIPT = Path(__file__).parent / "scripts" / "adapter_engine_layouts.py"
NPROC = 2


@pytest.fixture(scope="module")
def launch(hf_dirs, tmp_path_factory):
    """The checkpoints, the adapters and peft's logprobs written, then the launch."""
    work = tmp_path_factory.mktemp("adapter_layouts")
    ids = token_batch(batch=2)
    want = {}
    for family, cases in CASES.items():
        (work / f"hf_{family}").symlink_to(hf_dirs[family])
        for case in cases:
            assert PARITY[case][0] == family, case
            lora = PARITY[case][1]
            want[case], want[f"base_{family}"] = write_adapter(
                family, work / f"ad_{case}", ids, **lora
            )
    np.savez(work / "peft.npz", **want)
    np.save(work / "ids.npy", ids.numpy())
    np.save(work / "mixed_ids.npy", token_batch(seed=1, batch=5).numpy())
    out = work / "out"
    out.mkdir()
    return run_check_script(SCRIPT, NPROC, out, "adapters_rank", str(work), timeout=580)


@pytest.mark.parametrize("name", checks())
def test_served_adapters_in_layout(launch, name):
    for rank in range(NPROC):
        result = launch["checks"][rank].get(name)
        assert result is not None, f"rank {rank} did not run {name}:\n{launch['error']}"
        assert result == "ok", f"rank {rank} {name}:\n{result}"

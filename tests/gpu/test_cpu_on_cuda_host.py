"""Issue 20 item 6 on a real CUDA host: ``--device cpu`` builds and scores on the CPU, and
explicitly addressed CUDA still works in that process.

Runs in a subprocess: ``cpu_compat`` makes the CPU the process's current device, which a
CUDA model built later in the same process must not see. The simulated-host unit test of
the same logic: ``tests/unit/test_cpu_compat.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent(
    """
    import torch
    from megascore.engine.runtime import DistributedEngine
    from megascore.config import EngineConfig
    from megascore.api.types import ScoreBatch
    import numpy as np

    assert torch.cuda.is_available()
    for model in ("tiny", "tiny-moe"):
        engine = DistributedEngine.create(EngineConfig(model=model, device="cpu"))
        assert next(engine.loaded.model.parameters()).device.type == "cpu"
        ids = np.random.default_rng(0).integers(0, 512, 40)
        out = engine.score(ScoreBatch(token_ids=ids, lengths=np.array([15, 25])))
        assert np.isfinite(out.logprobs).all()
        engine.shutdown()
    x = torch.zeros(4, 4, device="cuda:0") + 1
    assert x.device.type == "cuda" and float((x @ x).sum()) == 64.0
    torch.cuda.synchronize()
    print("OK")
    """
)


def test_cpu_model_on_a_cuda_host(tmp_path):
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    env.setdefault("MASTER_PORT", "29517")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]

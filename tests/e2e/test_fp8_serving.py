"""Issue 20 item 3 through the real server: a DeepSeek-V3 checkpoint in DeepSeek's FP8
block layout served by ``megascore serve --model hf:DIR``.

A tiny random transformers DeepseekV3 model (MLA with a query LoRA and YaRN, sigmoid
router with expert groups, a dense first layer, a shared expert, an MTP layer) is saved,
then rewritten as DeepSeek publishes V3 / R1: every projection ``F8_E4M3`` with a float32
``weight_scale_inv`` per block and ``quantization_config`` in config.json
(``testkit.checkpoints.quantize_checkpoint_fp8``; blocks of 32 x 24 so
that the tiny matrices have several blocks, partial last blocks, and TP=2 slices that
start inside a block). Served at TP=2 in float32, its logprobs and top-k equal those of
transformers holding the dequantised weights (max |delta| <= 1e-4); the reference on the
original (unquantised) weights differs by far more, so the server did dequantise.
"""

from __future__ import annotations

import numpy as np
import pytest

from megascore_client import ScoringClient
from testkit.checkpoints import (
    load_dequantised,
    make_hf_model,
    quantize_checkpoint_fp8,
    save_hf_model,
)
from tests.e2e.server_pool import ServerSpec, module_pool
from tests.e2e.test_checkpoint_serving import PARITY_SEQS, TOP_K, hf_reference, max_error

pytestmark = pytest.mark.timeout(900)

ATOL = 1e-4  # fp32 Megatron vs fp32 transformers, compared in float64
FAMILY = "deepseek_v3"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fp8") / FAMILY
    model = make_hf_model(FAMILY, seed=3)
    save_hf_model(model, FAMILY, directory, seed=3)
    original = hf_reference(model, PARITY_SEQS)
    load_dequantised(model, quantize_checkpoint_fp8(directory))
    return directory.resolve(), model, original


@pytest.fixture(scope="module")
def pool(request, checkpoint, tmp_path_factory):
    specs = {"tp2": ServerSpec(f"hf:{checkpoint[0]}", 2, ("--tp", "2"))}
    yield from module_pool(request, tmp_path_factory, "serve-fp8", specs)


@pytest.fixture
def server(pool, config):
    yield from pool.lend(config)


@pytest.mark.parametrize("config", ["tp2"])
def test_fp8_checkpoint_matches_transformers_on_dequantised_weights(server, config, checkpoint):
    directory, model, original = checkpoint
    refs = hf_reference(model, PARITY_SEQS)
    with ScoringClient(server.target, timeout=120.0, retries=None) as client:
        info = client.model_info()
        result = client.score(PARITY_SEQS, top_k=TOP_K)
    assert info.architecture == FAMILY and info.parallel.world_size == 2
    err = max_error(result, PARITY_SEQS, refs)
    assert err <= ATOL, f"max |delta logprob| {err:.3e}"
    for i, ref in enumerate(refs):
        vals = result.top_k_logprobs[i].astype(np.float64)
        np.testing.assert_allclose(vals[1:], ref.top_k, rtol=0, atol=ATOL)
    quantisation = max_error(result, PARITY_SEQS, original)
    assert quantisation > 100 * ATOL, f"FP8 rounding changed logprobs by {quantisation:.1e} only"

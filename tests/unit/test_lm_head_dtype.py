"""Issue 16: ``--lm-head-dtype``: logits in the model dtype (Megatron's default) or float32.

On a bfloat16 model the output layer's bf16 matmul rounds every logit (about 1e-3
relative); ``float32`` multiplies the same bf16 hidden states and weights in float32.
Both are compared with the same product in float64: float32 is exact to ~1e-6, the
model dtype is off by the bf16 rounding, and an engine step with
``StepConfig.lm_head_dtype`` gives the float32 numbers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megascore.api.types import ScoreBatch
from megascore.config import EngineConfig
from megascore.engine.outputs.logprobs import Float32Logits, score_tokens
from megascore.engine.schedule.step import StepConfig, StepGroups, run_step
from megascore.engine.schedule.step_output import finish_step
from megascore.model.build import build_model
from megascore.model.config import builtin_model
from tests.packed_forward import forward_packed
from tests.padded_rows import pack_rows

LENGTHS = [9, 1, 14]


@pytest.fixture(scope="module")
def bf16_model(pgs):
    return build_model(builtin_model("tiny"), EngineConfig(device="cpu", dtype="bfloat16"), pgs)


def _ids() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(1, 512, (sum(LENGTHS),), generator=gen)


def test_float32_head_is_exact_and_model_dtype_rounds(bf16_model):
    ids = _ids()
    rows = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.int64)
    offsets = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    for i, (o, n) in enumerate(zip(offsets, LENGTHS, strict=True)):
        rows[i, :n] = ids[o : o + n]
    packed = pack_rows(rows, torch.tensor(LENGTHS))
    head = forward_packed(bf16_model, packed).head
    targets = torch.randint(0, 512, (head.num_tokens,), generator=torch.Generator().manual_seed(4))
    # the same bf16 hidden states times the same bf16 weight, in float64: [T, V]
    exact = head.hidden_states[:, 0].double() @ head.output_layer.weight.double().T
    want = torch.log_softmax(exact, -1).gather(-1, targets[:, None])[:, 0]
    model = score_tokens(head, targets, tp_group=None, chunk_tokens=8).logprobs
    fp32 = score_tokens(Float32Logits(head), targets, tp_group=None, chunk_tokens=8).logprobs
    err_model = (model.double() - want).abs().max().item()
    err_fp32 = (fp32.double() - want).abs().max().item()
    assert head.logits(0, 4).dtype == torch.bfloat16
    assert Float32Logits(head).logits(0, 4).dtype == torch.float32
    assert err_fp32 < 1e-5, err_fp32
    assert err_model > 20 * err_fp32, (err_model, err_fp32)


def test_engine_step_uses_the_configured_head_dtype(bf16_model, pgs):
    batch = ScoreBatch(token_ids=_ids().numpy(), lengths=np.array(LENGTHS), top_k=3)
    groups = StepGroups(tp=pgs.tp, cp=pgs.cp, pp=pgs.pp, status=dist.group.WORLD)
    outs = {}
    for dtype in ("model", "float32"):
        cfg = StepConfig(
            pad_multiple=1, chunk_tokens=8, vocab_size=512, device="cpu", lm_head_dtype=dtype
        )
        outs[dtype] = finish_step(batch, run_step(bf16_model, batch, groups, cfg))
    # float32 logits: what the float64 product gives, to float32 rounding
    ids = _ids()
    packed = pack_rows(ids[None, :9], torch.tensor([9]))
    head = forward_packed(bf16_model, packed).head
    exact = head.hidden_states[:, 0].double() @ head.output_layer.weight.double().T
    want = torch.log_softmax(exact, -1)[:-1].gather(-1, ids[1:9, None])[:, 0].numpy()
    got32, got_model = outs["float32"].logprobs[1:9], outs["model"].logprobs[1:9]
    assert abs(got32 - want).max() < 1e-5
    assert abs(got_model - want).max() > 20 * abs(got32 - want).max()

"""Chunked LM head: logprobs / top-k from hidden states, never ``[T_local, V/tp]`` logits.

(a) scores from ``forward_packed``'s head, chunk by chunk, equal scores from the full
    logits of GPTModel's own output path (the pre-chunking result) to 1e-6 in fp32
    (chunks of >= 16 rows; a few ulp more for 1-7-row chunks, see the test);
(b) an engine step with ``T_local > chunk_tokens`` asks the output head for at most
    ``chunk_tokens`` rows at a time, each row once, and no tensor with
    ``T_local x V/tp`` elements (or more than ``chunk_tokens`` vocabulary-wide rows)
    is ever created: every aten op's output is checked through a ``TorchDispatchMode``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megascore.api.types import ScoreBatch
from megascore.config import EngineConfig
from megascore.engine.outputs.logprobs import score_tokens
from megascore.engine.outputs.output_head import OutputHead
from megascore.engine.schedule.packed_inputs import packed_labels_and_mask, packed_position_ids
from megascore.engine.schedule.step import StepConfig, StepGroups, run_step
from megascore.engine.schedule.step_output import finish_step
from megascore.model.build import build_model
from megascore.model.config import ModelConfig, builtin_model
from tests.packed_forward import forward_packed
from tests.padded_rows import pack_rows

EQUIV_TOL = 1e-6
SMALL_CHUNK_TOL = 4e-6
TOP_K = 8
MODELS = {
    "tiny": builtin_model("tiny"),
    "tiny-moe": builtin_model("tiny-moe"),
    "tiny-tied": dataclasses.replace(
        builtin_model("tiny"), share_embeddings_and_output_weights=True
    ),
    "tiny-moe-no-mtp": dataclasses.replace(builtin_model("tiny-moe"), mtp_num_layers=None),
}


def _build(pgs, model_cfg: ModelConfig):
    return build_model(model_cfg, EngineConfig(device="cpu"), pgs)


def _packed(lengths: list[int], vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), max(lengths)), generator=gen)
    return pack_rows(ids, torch.tensor(lengths), pad_individual_seqs_to_multiple_of=4)


def _gptmodel_full_logits(model, packed) -> torch.Tensor:
    """GPTModel's own output path (output_layer on every hidden state): [T, V]."""
    positions = packed_position_ids(packed.cu_seqlens_padded, 0, 1)
    with torch.no_grad():
        logits = model(
            input_ids=packed.input_ids,
            position_ids=positions,
            attention_mask=None,
            packed_seq_params=packed.packed_seq_params,
        )  # [1, T, V]
    return logits[0]


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-tied"])
def test_chunked_scores_equal_full_logit_scores(pgs, name):
    model = _build(pgs, MODELS[name])
    packed = _packed([7, 1, 40, 3, 19, 2], model.vocab_size, seed=1)
    targets = packed_labels_and_mask(packed, 0, 1)[0][0]
    num_tokens = targets.numel()
    temperature = torch.linspace(0.5, 1.5, num_tokens)
    full = _gptmodel_full_logits(model, packed)
    scoring = dict(
        tp_group=pgs.tp, temperature=temperature, top_k=TOP_K, vocab_size=model.vocab_size
    )
    want = score_tokens(full, targets, chunk_tokens=num_tokens, **scoring)
    outputs = [forward_packed(model, packed)]
    if MODELS[name].is_moe:  # the metrics forward (training mode) hands over the same head
        outputs.append(
            forward_packed(model, packed, return_moe_metrics=True, return_mtp_metrics=True)
        )
    for out in outputs:
        assert out.head.num_tokens == num_tokens and out.head.vocab_local == model.vocab_size
        for chunk_tokens in (1, 7, 16, 33, 64):
            got = score_tokens(out.head, targets, chunk_tokens=chunk_tokens, **scoring)
            # The fp32 GEMM kernel depends on the row count: chunks of 1-7 rows (gemv /
            # narrow kernels) give logits a few ulp away from the all-rows GEMM; from 16
            # rows on they are bitwise equal here.
            tol = EQUIV_TOL if chunk_tokens >= 16 else SMALL_CHUNK_TOL
            assert (got.logprobs - want.logprobs).abs().max().item() <= tol
            assert (got.top_k_logprobs - want.top_k_logprobs).abs().max().item() <= tol
            assert torch.equal(got.top_k_ids, want.top_k_ids)


class _LargestOutputs(TorchDispatchMode):
    """Records, over every aten op's outputs, the largest tensor and the most rows of any
    tensor whose last dimension is the vocabulary slice."""

    def __init__(self, vocab_local: int):
        super().__init__()
        self.vocab_local = vocab_local
        self.max_numel = 0
        self.max_vocab_rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
                if t.dim() >= 1 and t.shape[-1] == self.vocab_local:
                    self.max_vocab_rows = max(self.max_vocab_rows, t.numel() // self.vocab_local)
        return out


@pytest.mark.parametrize(
    "name, metrics",
    [("tiny", False), ("tiny-moe", False), ("tiny-moe-no-mtp", True)],
    ids=["tiny", "tiny-moe", "moe-training-forward"],
)
def test_step_never_materialises_all_rows_of_logits(pgs, monkeypatch, name, metrics):
    """A step over 687 tokens with chunk_tokens=96: the output layer sees <= 96 rows per call
    (each row once, GPTModel itself never calls it) and no op creates a tensor with
    T_local x V/tp elements. (Sequences are short so that attention scores stay small.)"""
    model_cfg = MODELS[name]
    model = _build(pgs, model_cfg)
    chunk_tokens, vocab = 96, model_cfg.vocab_size
    lengths = np.array([50] * 13 + [37])
    rng = np.random.default_rng(2)
    batch = ScoreBatch(
        token_ids=rng.integers(0, vocab, int(lengths.sum())),
        lengths=lengths,
        top_k=TOP_K,
        losses=("nll",),
        return_logprobs=True,
        return_moe_metrics=metrics,
    )
    num_tokens = int(lengths.sum())  # pad multiple 1: T_local = tokens
    assert num_tokens > 7 * chunk_tokens

    rows_per_call, layer_calls = [], []
    head_logits = OutputHead.logits

    def spy(head, start, end):
        rows_per_call.append(end - start)
        return head_logits(head, start, end)

    monkeypatch.setattr(OutputHead, "logits", spy)
    # the head multiplies by the layer's weight itself (the reused buffer): nothing,
    # GPTModel included, calls the output layer
    monkeypatch.setattr(model.output_layer, "forward", lambda *a, **k: layer_calls.append(a))
    groups = StepGroups(tp=pgs.tp, cp=pgs.cp, pp=pgs.pp, status=dist.group.WORLD)
    cfg = StepConfig(pad_multiple=1, chunk_tokens=chunk_tokens, vocab_size=vocab, device="cpu")
    watch = _LargestOutputs(vocab_local=vocab)
    with watch:
        result = run_step(model, batch, groups, cfg)
    out = finish_step(batch, result)

    assert max(rows_per_call) <= chunk_tokens and sum(rows_per_call) == num_tokens
    assert not layer_calls
    assert len(rows_per_call) == -(-num_tokens // chunk_tokens)
    assert watch.max_vocab_rows <= chunk_tokens, watch.max_vocab_rows
    assert watch.max_numel < num_tokens * vocab, watch.max_numel
    assert np.isfinite(out.logprobs).all() and out.top_k_ids.shape == (num_tokens, TOP_K)
    # the schedule's loss: the step's token-mean NLL, normalised by the global token count
    want_loss = out.losses["nll"].sum() / out.num_loss_tokens.sum()
    assert result.loss == pytest.approx(want_loss, rel=1e-5)
    assert set(out.moe_metrics) == (
        {"load_balancing_loss", "seq_load_balancing_loss", "z_loss"} if metrics else set()
    )


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("name", ["tiny", "tiny-tied"])
def test_logits_in_the_reused_buffer_are_the_layers_bit_for_bit(pgs, name, invariant):
    """The head writes each chunk's logits into one buffer kept on the output layer; they
    equal what Megatron's output layer returns for the same rows, bit for bit."""
    from megascore.model.batch_invariant import make_batch_invariant

    model = _build(pgs, MODELS[name])
    if invariant:
        make_batch_invariant(model)
    packed = _packed([7, 1, 40, 3, 19, 2], model.vocab_size, seed=2)
    head = forward_packed(model, packed).head
    assert head.scratch is not None
    layer_path = dataclasses.replace(head, scratch=None)
    assert head.num_tokens == 80
    pointers = set()
    for start, end in ((0, 41), (41, 46), (46, 47), (47, 80)):  # the largest chunk first
        got = head.logits(start, end)
        assert torch.equal(got, layer_path.logits(start, end)), (start, end)
        pointers.add(got.data_ptr())
    assert len(pointers) == 1  # every chunk in the one buffer
    # the next forward of the same model reuses it as well
    again = forward_packed(model, _packed([5, 9], model.vocab_size, seed=3)).head
    assert again.logits(0, again.num_tokens).data_ptr() in pointers

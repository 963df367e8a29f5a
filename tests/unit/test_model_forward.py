"""Model build + packed forward on one gloo rank (in process).

(a) a packed forward equals the unpadded forward of every sequence alone;
(b) logits equal an independent plain-PyTorch Llama-style forward from the state dict;
(c) MoE / MTP metrics (``metrics_reduction="microbatch"``) equal a direct training-mode
    Megatron forward, model left untouched.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from megascore.config import EngineConfig
from megascore.engine.layout.packing import cp_shard_indices
from megascore.engine.schedule.forward import moe_metric_names, mtp_metric_names
from megascore.engine.schedule.packed_inputs import packed_labels_and_mask, packed_position_ids
from megascore.model.build import build_model, resolve_attention_backend
from megascore.model.config import ModelConfig, builtin_model
from tests.packed_forward import forward_packed
from tests.padded_rows import pack_rows

TOL = 1e-5


def _build(pgs, model_cfg: ModelConfig, dtype: str = "float32"):
    return build_model(model_cfg, EngineConfig(device="cpu", dtype=dtype), pgs)


def _batch(lengths: list[int], vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), max(lengths)), generator=gen)
    return ids, torch.tensor(lengths)


def _full_logits(out) -> torch.Tensor:
    """All rows of the head's logits at once: [T, V] (small test batches only)."""
    return out.head.logits(0, out.head.num_tokens)


def _logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)


def _alone_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """Plain (non-packed) causal forward of one unpadded sequence: [L, V] logprobs."""
    tokens = ids[None]  # [1, L]
    with torch.no_grad():
        logits = model(tokens, torch.arange(ids.numel())[None], None)  # [1, L, V]
    return _logprobs(logits[0])


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
@pytest.mark.parametrize(
    "lengths, pad_multiple, pad_to",
    [
        ([7, 1, 12, 1, 5], 1, None),
        ([1024], 1, None),  # at max_position_embeddings
        ([300] + [1, 2, 3, 4, 5, 6, 7, 8], 4, 400),  # one long + many short, padded
    ],
)
def test_packed_equals_each_sequence_alone(pgs, name, lengths, pad_multiple, pad_to):
    model = _build(pgs, builtin_model(name))
    ids, lens = _batch(lengths, model.vocab_size)
    packed = pack_rows(
        ids, lens, pad_individual_seqs_to_multiple_of=pad_multiple, pad_packed_seq_to=pad_to
    )
    out = forward_packed(model, packed)
    assert out.head.num_tokens == packed.input_ids.shape[1]
    assert out.head.vocab_local == model.vocab_size
    assert out.moe_metrics == {} and out.mtp_metrics == {}
    packed_lp = _logprobs(_full_logits(out))
    starts = packed.cu_seqlens_padded.tolist()
    for b, length in enumerate(lengths):
        alone = _alone_logprobs(model, ids[b, :length])
        diff = (packed_lp[starts[b] : starts[b] + length] - alone).abs().max().item()
        assert diff <= TOL, f"sequence {b} (length {length}): max |dlogprob| {diff}"


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_logits(sd: dict, cfg: ModelConfig, ids: torch.Tensor) -> torch.Tensor:
    """Llama-style forward in float64 from Megatron's state dict: [L] ids -> [L, V] logits."""
    sd = {k: v.double() for k, v in sd.items() if torch.is_tensor(v)}
    n_len, nh, ng, hd = ids.numel(), cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    eps = cfg.layernorm_epsilon
    inv_freq = 1.0 / cfg.rotary_base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.outer(torch.arange(n_len, dtype=torch.float64), inv_freq)
    cos, sin = (
        torch.cat([angles.cos()] * 2, -1)[:, None],
        torch.cat([angles.sin()] * 2, -1)[:, None],
    )

    def rope(x):  # x: [L, heads, hd], rotate-half (non-interleaved)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    h = sd["embedding.word_embeddings.weight"][ids]  # [L, hidden]
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        x = _rms(h, sd[p + "input_layernorm.weight"], eps)
        # linear_qkv rows: per query group [nh/ng query heads, 1 key, 1 value] x hd
        qkv = (x @ sd[p + "self_attention.linear_qkv.weight"].T).view(n_len, ng, nh // ng + 2, hd)
        q = qkv[:, :, : nh // ng].reshape(n_len, nh, hd)
        k, v = qkv[:, :, nh // ng], qkv[:, :, nh // ng + 1]  # [L, ng, hd]
        if cfg.qk_layernorm:
            q = _rms(q, sd[p + "self_attention.q_layernorm.weight"], eps)
            k = _rms(k, sd[p + "self_attention.k_layernorm.weight"], eps)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(nh // ng, 1), v.repeat_interleave(nh // ng, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        causal = torch.ones(n_len, n_len, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        ctx = torch.einsum("hqk,khd->qhd", probs, v).reshape(n_len, nh * hd)
        h = h + ctx @ sd[p + "self_attention.linear_proj.weight"].T
        x = _rms(h, sd[p + "pre_mlp_layernorm.weight"], eps)
        gate, up = (x @ sd[p + "mlp.linear_fc1.weight"].T).chunk(2, -1)
        h = h + (F.silu(gate) * up) @ sd[p + "mlp.linear_fc2.weight"].T
    h = _rms(h, sd["decoder.final_layernorm.weight"], eps)
    out_w = sd.get("output_layer.weight", sd["embedding.word_embeddings.weight"])
    if cfg.share_embeddings_and_output_weights:
        out_w = sd["embedding.word_embeddings.weight"]
    return h @ out_w.T


QWEN3_LIKE = dataclasses.replace(
    builtin_model("tiny"),
    qk_layernorm=True,
    share_embeddings_and_output_weights=True,
    rotary_base=1_000_000.0,
    num_query_groups=1,
    layernorm_epsilon=1e-5,
)


@pytest.mark.parametrize("model_cfg", [builtin_model("tiny"), QWEN3_LIKE], ids=["tiny", "qwen3"])
def test_logits_match_plain_pytorch_reference(pgs, model_cfg):
    model = _build(pgs, model_cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # norms start at 1: perturb them so the test sees their mapping
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
    ids, lens = _batch([9, 1, 16], model_cfg.vocab_size, seed=4)
    packed = pack_rows(ids, lens)
    packed_lp = _logprobs(_full_logits(forward_packed(model, packed)))
    sd = model.state_dict()
    starts = packed.cu_seqlens_padded.tolist()
    for b, length in enumerate(lens.tolist()):
        ref = _logprobs(_reference_logits(sd, model_cfg, ids[b, :length]))
        diff = (packed_lp[starts[b] : starts[b] + length] - ref).abs().max().item()
        assert diff <= TOL, f"sequence {b}: max |dlogprob| {diff}"


def test_weights_depend_only_on_seed(pgs):
    a = _build(pgs, builtin_model("tiny")).state_dict()
    b = _build(pgs, builtin_model("tiny")).state_dict()
    c = build_model(builtin_model("tiny"), EngineConfig(device="cpu", seed=7), pgs).state_dict()
    w = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert torch.equal(a[w], b[w]) and not torch.equal(a[w], c[w])
    assert torch.equal(a["decoder.final_layernorm.weight"], torch.ones(64))


def test_bf16_model_runs_close_to_fp32(pgs):
    ids, lens = _batch([10, 4], 512, seed=5)
    packed = pack_rows(ids, lens)
    lp32 = _logprobs(_full_logits(forward_packed(_build(pgs, builtin_model("tiny")), packed)))
    logits16 = _full_logits(forward_packed(_build(pgs, builtin_model("tiny"), "bfloat16"), packed))
    assert logits16.dtype == torch.bfloat16
    assert (_logprobs(logits16) - lp32).abs().max().item() < 0.1


def test_backend_resolution_on_cpu():
    cpu = torch.device("cpu")
    assert resolve_attention_backend(EngineConfig(attention_backend="auto"), cpu) == "torch"
    with pytest.raises(ValueError, match="te"):
        resolve_attention_backend(EngineConfig(attention_backend="te"), cpu)


def _reference_metrics(model, ids, lens, packed, n_moe_layers):
    """Training-mode Megatron forward read straight from the trackers (pads masked with
    Megatron's ``padding_mask``)."""
    total = packed.input_ids.shape[1]
    padding_mask = torch.ones(1, total, dtype=torch.bool)
    labels = torch.zeros(1, total, dtype=torch.long)
    loss_mask = torch.zeros(1, total)
    positions = torch.zeros(1, total, dtype=torch.long)
    for b, (start, end) in enumerate(
        zip(packed.cu_seqlens_padded[:-1], packed.cu_seqlens_padded[1:], strict=True)
    ):
        length = int(lens[b])
        positions[0, start:end] = torch.arange(end - start)
        labels[0, start : start + length - 1] = ids[b, 1:length]
        loss_mask[0, start : start + length - 1] = 1.0
        padding_mask[0, start : start + length] = False
    get_moe_metrics_tracker().clear()
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    model.train()
    try:
        with torch.enable_grad():
            model(
                packed.input_ids,
                positions,
                None,
                labels=labels,
                loss_mask=loss_mask,
                packed_seq_params=packed.packed_seq_params,
                padding_mask=padding_mask,
            )
    finally:
        model.eval()
    metrics = get_moe_metrics_tracker().metrics
    moe = {n: metrics[n].values.sum().item() / n_moe_layers for n in moe_metric_names(model.config)}
    t = MTPLossLoggingHelper.tracker
    mtp = {
        "mtp_1_loss": t["loss_values"][0].item(),
        "mtp_1_acceptance_rate": (t["correct_values"][0] / t["total_values"][0] * 100).item(),
    }
    get_moe_metrics_tracker().clear()
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    return moe, mtp


@pytest.mark.parametrize("pad_multiple", [1, 4])
def test_moe_mtp_metrics_equal_training_forward(pgs, pad_multiple):
    model_cfg = builtin_model("tiny-moe")
    model = _build(pgs, model_cfg)
    ids, lens = _batch([11, 1, 6, 3], model_cfg.vocab_size, seed=6)
    packed = pack_rows(ids, lens, pad_individual_seqs_to_multiple_of=pad_multiple)
    before = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    eval_head = forward_packed(model, packed).head

    metrics = dict(return_moe_metrics=True, return_mtp_metrics=True)
    out = forward_packed(model, packed, metrics_reduction="microbatch", **metrics)
    assert set(out.moe_metrics) == {"load_balancing_loss", "seq_load_balancing_loss", "z_loss"}
    assert list(out.mtp_metrics) == mtp_metric_names(model_cfg)
    assert torch.equal(out.head.hidden_states, eval_head.hidden_states)
    assert torch.equal(_full_logits(out), eval_head.logits(0, eval_head.num_tokens))
    assert not model.training
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)

    again = forward_packed(model, packed, metrics_reduction="microbatch", **metrics)
    assert again.moe_metrics == out.moe_metrics and again.mtp_metrics == out.mtp_metrics

    n_moe_layers = model_cfg.num_layers + model_cfg.mtp_num_layers  # every layer is MoE
    ref_moe, ref_mtp = _reference_metrics(model, ids, lens, packed, n_moe_layers)
    for name, value in {**ref_moe, **ref_mtp}.items():
        got = {**out.moe_metrics, **out.mtp_metrics}[name]
        assert got == pytest.approx(value, rel=1e-6, abs=1e-7), name
    assert out.mtp_metrics["mtp_1_loss"] > 0 and out.moe_metrics["z_loss"] > 0
    # pads are masked out of the statistics: the unpadded packing reports the same metrics
    unpadded = forward_packed(
        model, pack_rows(ids, lens), metrics_reduction="microbatch", **metrics
    )
    for name, value in {**unpadded.moe_metrics, **unpadded.mtp_metrics}.items():
        got = {**out.moe_metrics, **out.mtp_metrics}[name]
        assert got == pytest.approx(value, rel=1e-6, abs=1e-7), name
    # the step definition (the default) differs from one microbatch's value only in the
    # sequence-level loss (per request sequence, not per packed microbatch)
    step = forward_packed(model, packed, **metrics)
    for name, value in {**step.moe_metrics, **step.mtp_metrics}.items():
        if name != "seq_load_balancing_loss":
            got = {**out.moe_metrics, **out.mtp_metrics}[name]
            assert got == pytest.approx(value, rel=1e-6, abs=1e-7), name


def test_metrics_requested_from_dense_model_raise(pgs):
    model = _build(pgs, builtin_model("tiny"))
    packed = pack_rows(*_batch([4], 512))
    with pytest.raises(ValueError, match="dense"):
        forward_packed(model, packed, return_moe_metrics=True)
    with pytest.raises(ValueError, match="MTP"):
        forward_packed(model, packed, return_mtp_metrics=True)


@pytest.mark.parametrize("cp_size", [1, 2])
def test_labels_mask_and_positions_follow_the_padded_segments(cp_size):
    ids = torch.tensor([[5, 6, 7, 8, 9], [3, 0, 0, 0, 0], [1, 2, 0, 0, 0]])
    lens = torch.tensor([5, 1, 2])
    full_labels, full_mask, full_pos = [], [], []
    for rank in range(cp_size):
        packed = pack_rows(
            ids, lens, pad_individual_seqs_to_multiple_of=4, cp_rank=rank, cp_size=cp_size
        )
        labels, mask = packed_labels_and_mask(packed, rank, cp_size)
        pos = packed_position_ids(packed.cu_seqlens_padded, rank, cp_size)
        idx = cp_shard_indices(packed.cu_seqlens_padded, rank, cp_size)
        for full, local in ((full_labels, labels), (full_mask, mask), (full_pos, pos)):
            full.append((idx, local[0]))

    def assemble(parts):
        out = torch.zeros(16, dtype=parts[0][1].dtype)
        for idx, local in parts:
            out[idx] = local
        return out.tolist()

    # segments [0, 8) [8, 12) [12, 16)
    assert assemble(full_labels) == [6, 7, 8, 9, 0, 0, 0, 5, 0, 0, 0, 3, 2, 0, 0, 1]
    assert assemble(full_mask) == [1, 1, 1, 1] + [0] * 8 + [1, 0, 0, 0]
    assert assemble(full_pos) == list(range(8)) + list(range(4)) + list(range(4))


def test_loss_mask_override_reaches_mtp(pgs):
    model = _build(pgs, builtin_model("tiny-moe"))
    packed = pack_rows(*_batch([9, 5], 512, seed=8))
    total = packed.input_ids.shape[1]
    none = forward_packed(
        model, packed, return_mtp_metrics=True, loss_mask_packed_local=torch.zeros(total)
    )
    assert none.mtp_metrics == {"mtp_1_loss": 0.0, "mtp_1_acceptance_rate": 0.0}
    default = forward_packed(model, packed, return_mtp_metrics=True)
    assert default.mtp_metrics["mtp_1_loss"] > 0


def test_moe_metrics_of_length_one_sequences_are_finite(pgs):
    """No position of a length-1 sequence has a next token: the MTP layer's router sees
    no real token and contributes 0 (not 0 / 0) to the mean over layers."""
    model = _build(pgs, builtin_model("tiny-moe"))
    single = forward_packed(
        model, pack_rows(*_batch([1, 1], 512, seed=3)), return_moe_metrics=True
    ).moe_metrics
    assert all(math.isfinite(v) for v in single.values()), single
    longer = forward_packed(
        model, pack_rows(*_batch([1, 4], 512, seed=3)), return_moe_metrics=True
    ).moe_metrics
    assert all(math.isfinite(v) for v in longer.values()) and longer != single

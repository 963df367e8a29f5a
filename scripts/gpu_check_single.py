"""The parity and single-GPU rows of ``scripts/gpu_check.py``: what one GPU can prove
without a second rank. Every row also runs with ``--device cpu`` (smaller shapes,
float32; tests/unit/test_gpu_check_rows.py runs them in CI), so a GPU run only adds the
device.

* parity: a tiny Llama with rescaled weights (logits spread over several nats) and a
  128k vocabulary, six sequences of different lengths packed in one step (real RoPE
  positions up to 500 on a GPU), against transformers in float32 one sequence at a
  time: logprobs (float32 and the device's bfloat16) and top-256 ids;
* MLA: DeepSeek-V3-shaped checkpoints with and without the query down-projection
  (``q_lora_rank`` null), the default attention backend (TE where it imports);
* FP8: a block-quantised DeepSeek-V3 checkpoint against transformers on the
  dequantised weights;
* top-256 over a 128k vocabulary: bfloat16-rounded logits (exact ties at the boundary)
  against an exact (value, id) ordering; time and peak memory;
* bf16 LM head vs ``--lm-head-dtype float32`` against transformers in float32;
* ``attention_with_lse`` with a bias (a CP chunk's mask) against a float64 softmax;
* memory: 500 engine steps of varying lengths (12 on the CPU); allocated and reserved
  bytes (the CPU: resident bytes) after the first tenth stay flat.
"""

from __future__ import annotations

import time

import numpy as np
from gpu_check_rows import bench_common
from gpu_check_serve import BF16_FLOOR, bf16_tolerance, compare, engine_logprobs

VOCAB = 128256  # Llama 3's
TOP_K = 256
LENGTHS = {"cuda": (7, 64, 129, 250, 384, 500), "cpu": (5, 17, 24, 33, 40, 48)}
MEMORY_STEPS = {"cuda": 500, "cpu": 12}
MEMORY_SLACK = {"cuda": 64 * 2**20, "cpu": 96 * 2**20}  # bytes a flat run may move by


def _sequences(device: str):
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, n) for n in LENGTHS[device]]


def _reference(model, seqs):
    """transformers in float32, one sequence at a time: target logprobs (flat, entry 0 of
    each sequence 0.0) and each position's top-256 ids by float64 logits."""
    import torch

    logprobs, top = [], []
    with torch.no_grad():
        for seq in seqs:
            logits = model(torch.as_tensor(seq)[None]).logits[0].double()  # [n, V]
            lp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.as_tensor(seq[1:])[:, None])
            logprobs.append(np.concatenate([[0.0], lp[:, 0].numpy()]))
            top.append(torch.topk(logits[:-1], TOP_K + 1, -1))
    return np.concatenate(logprobs), top


def _score(model: str, device: str, dtype: str, seqs, **options):
    from megascore.api.types import ScoreBatch
    from megascore.config import EngineConfig
    from megascore.engine.runtime import DistributedEngine

    engine = DistributedEngine.create(
        EngineConfig(model=model, device=device, dtype=dtype, **options)
    )
    try:
        lengths = np.array([len(s) for s in seqs])
        batch = ScoreBatch(token_ids=np.concatenate(seqs), lengths=lengths, top_k=TOP_K)
        return engine.score(batch), engine.info().attention_backend
    finally:
        engine.shutdown()


def _top_k_agreement(out, top, seqs) -> tuple[int, int]:
    """(positions whose top-256 set equals the reference's, positions compared): positions
    whose 256th and 257th reference logits lie within 1e-4 are left out (a near tie)."""
    same = compared = 0
    start = 0
    for seq, ref in zip(seqs, top, strict=True):
        for t in range(1, len(seq)):
            values = ref.values[t - 1]
            if values[TOP_K - 1] - values[TOP_K] < 1e-4:
                continue
            compared += 1
            got = set(out.top_k_ids[start + t].tolist())
            same += got == set(ref.indices[t - 1, :TOP_K].tolist())
        start += len(seq)
    return same, compared


def _llama_128k(ctx):
    from testkit.checkpoints import make_hf_model, save_hf_model

    model = make_hf_model("llama", vocab_size=VOCAB)
    directory = ctx.out / "hf_llama_128k"
    if not directory.exists():
        save_hf_model(model, "llama", directory)
    return model, f"hf:{directory}"


def parity(ctx) -> tuple[str, str]:
    """The engine on the device, six packed sequences, vs transformers per sequence."""
    bench_common()
    model, spec = _llama_128k(ctx)
    seqs = _sequences(ctx.device)
    ref, top = _reference(model, seqs)
    ok, details = True, []
    for dtype in ("float32", "bfloat16") if ctx.device == "cuda" else ("float32",):
        out, backend = _score(spec, ctx.device, dtype, seqs)
        good, detail = compare(out.logprobs.astype(np.float64), ref, dtype, BF16_FLOOR)
        same, compared = _top_k_agreement(out, top, seqs)
        if dtype == "float32":
            good &= same == compared
        ok &= good
        details.append(f"{dtype} ({backend}): {detail}; top-{TOP_K} sets {same}/{compared}")
    lengths = "/".join(map(str, LENGTHS[ctx.device]))
    return ("PASS" if ok else "FAIL"), f"lengths {lengths}, vocab {VOCAB}: " + "; ".join(details)


def _family_row(ctx, family: str, fp8: bool) -> tuple[bool, str]:
    from testkit.checkpoints import (
        hf_logprobs,
        load_dequantised,
        make_hf_model,
        quantize_checkpoint_fp8,
        token_batch,
        write_hf_checkpoint,
    )

    directory = ctx.out / f"hf_{family}{'_fp8' if fp8 else ''}"
    ids = token_batch()
    ref = write_hf_checkpoint(family, directory)
    model = make_hf_model(family)
    if fp8:
        load_dequantised(model, quantize_checkpoint_fp8(directory))
        ref = hf_logprobs(model, ids)
    tol = bf16_tolerance(model, ids, ref) if ctx.dtype == "bfloat16" else 0.0
    got, backend = engine_logprobs(f"hf:{directory}", ctx.device, ctx.dtype, ids)
    ok, detail = compare(got, ref, ctx.dtype, tol)
    return ok, f"{family} {ctx.dtype} ({backend}): {detail}"


def mla(ctx) -> tuple[str, str]:
    """DeepSeek-V3 MLA without and with the query down-projection vs transformers."""
    bench_common()
    rows = [_family_row(ctx, family, False) for family in ("deepseek_v3-qfull", "deepseek_v3")]
    return ("PASS" if all(ok for ok, _ in rows) else "FAIL"), "; ".join(d for _, d in rows)


def fp8(ctx) -> tuple[str, str]:
    """A block-FP8 DeepSeek-V3 checkpoint vs transformers on its dequantised weights."""
    bench_common()
    ok, detail = _family_row(ctx, "deepseek_v3", True)
    return ("PASS" if ok else "FAIL"), f"FP8 blocks dequantised at load; {detail}"


def top_k(ctx) -> tuple[str, str]:
    """``chunk_top_k`` on bfloat16-rounded logits ``[rows, 128k]`` vs an exact ordering
    (value descending, then id ascending): ids equal, time and peak memory."""
    import torch

    from megascore.engine.outputs.vocab_top_k import chunk_top_k

    rows = 1024 if ctx.device == "cuda" else 16
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, VOCAB, generator=gen).to(torch.bfloat16).float()
    dev = logits.to(ctx.device)
    work = torch.empty_like(dev)
    chunk_top_k(dev, TOP_K, 0, None, None, 1, work)  # warm-up
    if ctx.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    ids, values = chunk_top_k(dev, TOP_K, 0, None, None, 1, work)
    ids = ids.cpu()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base if ctx.device == "cuda" else 0
    order = [np.lexsort((np.arange(VOCAB), -row))[:TOP_K] for row in logits.numpy()]
    same = int((ids.numpy() == np.stack(order)).all(axis=1).sum())
    top = torch.topk(logits, TOP_K + 1, -1).values
    ties = int((top[:, TOP_K - 1] == top[:, TOP_K]).sum())
    detail = (
        f"{same}/{rows} rows equal the exact order; {ties} rows tied at the boundary; "
        f"{seconds * 1e3:.1f} ms; {peak / 2**20:.0f} MiB above the logits"
    )
    return ("PASS" if same == rows else "FAIL"), detail


def lm_head(ctx) -> tuple[str, str]:
    """A bfloat16 engine with its LM head in bfloat16 and in float32, vs transformers fp32:
    the float32 head is not further from it (its logits are not rounded)."""
    bench_common()
    model, spec = _llama_128k(ctx)
    seqs = _sequences(ctx.device)[:3]
    ref, _ = _reference(model, seqs)
    means = {}
    for head in ("model", "float32"):
        out, _ = _score(spec, ctx.device, "bfloat16", seqs, lm_head_dtype=head)
        means[head] = float(np.abs(out.logprobs.astype(np.float64) - ref).mean())
    ok = means["float32"] <= 1.1 * means["model"]
    detail = (
        f"mean |logprob - transformers fp32|: bf16 head {means['model']:.2e}, "
        f"fp32 head {means['float32']:.2e} (bf16 body, {ctx.device})"
    )
    return ("PASS" if ok else "FAIL"), detail


def attention_lse(ctx) -> tuple[str, str]:
    """``attention_with_lse`` with a bias (query i sees keys 0 .. offset + i) and GQA."""
    import torch

    from megascore.model.sdpa import attention_with_lse
    from testkit.reference import softmax_attention

    gen = torch.Generator().manual_seed(0)
    dtypes = (torch.float32, torch.bfloat16) if ctx.device == "cuda" else (torch.float32,)
    worst = []
    for q_len, k_len, offset in ((19, 53, 34), (40, 300, 260)):
        q = torch.randn(3, 8, q_len, 64, generator=gen)
        k, v = (torch.randn(3, 2, k_len, 64, generator=gen) for _ in range(2))
        mask = torch.arange(k_len)[None] <= torch.arange(q_len)[:, None] + offset
        ref_out, ref_lse = softmax_attention(q, k, v, mask, 64**-0.5)
        for dtype in dtypes:
            args = (x.to(ctx.device, dtype) for x in (q, k, v))
            out, lse = attention_with_lse(
                *args, causal=False, mask=mask.to(ctx.device), scale=64**-0.5
            )
            err = max((out.cpu().double() - ref_out).abs().max(), (lse.cpu() - ref_lse).abs().max())
            worst.append((float(err), 2e-5 if dtype == torch.float32 else 2e-2, str(dtype)[6:]))
    ok = all(err <= tol for err, tol, _ in worst)
    detail = ", ".join(f"{name} {err:.1e} (tol {tol:.0e})" for err, tol, name in worst)
    return ("PASS" if ok else "FAIL"), f"max |out, lse - float64 softmax|: {detail}"


def _memory_now(device: str) -> tuple[int, int]:
    import psutil
    import torch

    if device == "cuda":
        return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    rss = psutil.Process().memory_info().rss
    return rss, rss


def memory(ctx) -> tuple[str, str]:
    """Engine steps of varying lengths (the largest first); after the first tenth, the
    allocated and reserved bytes move by at most ``MEMORY_SLACK``."""
    common = bench_common()
    steps = MEMORY_STEPS[ctx.device]
    engine = common.create_engine(ctx.device, "bench" if ctx.device == "cuda" else "tiny")
    rng = np.random.default_rng(0)
    longest = 4096 if ctx.device == "cuda" else 128
    samples = []
    try:
        limit = engine.info().max_sequence_length
        vocab = engine.info().vocab_size
        for step in range(steps):
            n = int(rng.integers(1, 9))
            lengths = np.full(8, longest) if step == 0 else rng.integers(16, longest, n)
            lengths = np.minimum(lengths, limit)
            engine.score(common.score_batch([rng.integers(0, vocab, m) for m in lengths]))
            samples.append(_memory_now(ctx.device))
    finally:
        engine.shutdown()
    settled = np.array(samples[steps // 10 :], dtype=np.int64)  # [steps, 2]
    growth = settled.max(axis=0) - settled[0]
    ok = bool((growth <= MEMORY_SLACK[ctx.device]).all())
    what = "allocated / reserved" if ctx.device == "cuda" else "resident"
    detail = (
        f"{steps} steps; after step {steps // 10}: {what} grew by "
        f"{growth[0] / 2**20:.1f} / {growth[1] / 2**20:.1f} MiB (slack "
        f"{MEMORY_SLACK[ctx.device] / 2**20:.0f}); at the end {settled[-1, 0] / 2**20:.0f} / "
        f"{settled[-1, 1] / 2**20:.0f} MiB"
    )
    return ("PASS" if ok else "FAIL"), detail

"""Packed (THD) scoring vs padded batches: throughput and peak memory, side by side.

Runs the ``bench`` built-in model (~96M parameters) in one process (world size 1):

* **packed**: ``DistributedEngine.score`` on token-budget batches of the length
  mix (pack -> forward -> chunked vocab-parallel logprobs -> unpack -> losses);
* **padded**: the same model on batches of ``--batch-size`` sequences padded to
  the longest, plain causal attention per row (right padding: real tokens never
  see pads), full-vocabulary ``log_softmax`` on ``[B, S, V]`` logits, gather;
* **memory sweep**: peak memory of the packed path for token counts of one to
  several logprob chunks (``--chunk-tokens``) per batch, with a least-squares
  line (bytes per token, intercept, R^2). The logits are computed chunk by chunk
  from the final hidden states, so the slope holds activations only: it must stay
  far below the fp32 full-vocabulary logits of a token (``V x 4`` bytes), and the
  chunk's logits show up in the intercept.

Lengths are drawn from a seeded log-normal, clipped to ``[16, --max-len]``.
Memory is the peak RSS above the RSS before the phase (``VmHWM`` in
``/proc/self/status``, reset through ``/proc/self/clear_refs``), or
``torch.cuda.max_memory_allocated`` on a GPU. The two paths' logprobs are
compared as a sanity check.

Default (2 CPU cores): 8 sequences (median length 128), sweep 1024..4096
tokens (1-4 chunks of 1024), about 3-4 minutes. Bigger runs: ``--num-sequences
64 --median 400 --max-tokens 8192 --sweep 2048,4096,8192,16384``.

Usage::

    python bench/packed_forward.py [--device cpu|cuda] [--threads N] ...
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import time

import numpy as np
import torch

logger = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-sequences", type=int, default=8)
    p.add_argument("--median", type=float, default=128.0, help="median sequence length")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8, help="padded baseline batch size")
    p.add_argument("--max-tokens", type=int, default=4096, help="packed token budget per step")
    p.add_argument(
        "--sweep",
        default="1024,2048,3072,4096",
        help="tokens per batch, comma-separated (>= --chunk-tokens keeps the fit linear)",
    )
    p.add_argument("--sweep-seq-len", type=int, default=128)
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


# ---- memory ---------------------------------------------------------------------------------


class PeakMemory:
    """Peak memory of a code region above its starting point (RSS or CUDA allocator)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._libc = None
        if device.type == "cpu":
            self._libc = ctypes.CDLL("libc.so.6")
            # Fixed mmap threshold: large buffers are mmapped and returned to the OS on
            # free, so every phase starts from (and is measured above) a trimmed heap.
            self._libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)

    @staticmethod
    def _status_kib(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise RuntimeError(f"{field} not in /proc/self/status")

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        gc.collect()
        self._libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        self.base = self._status_kib("VmRSS") * 1024

    def stop(self) -> int:
        """Returns the peak bytes above the start."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return self._status_kib("VmHWM") * 1024 - self.base


# ---- workloads ------------------------------------------------------------------------------


def length_mix(args: argparse.Namespace) -> np.ndarray:
    rng = np.random.default_rng(args.seed)
    raw = rng.lognormal(np.log(args.median), args.sigma, args.num_sequences)
    return np.clip(np.round(raw), 16, args.max_len).astype(np.int64)


def token_budget_batches(lengths: np.ndarray, max_tokens: int) -> list[list[int]]:
    """Greedy, in order: sequence indices per packed step."""
    batches, current, used = [], [], 0
    for i, n in enumerate(lengths):
        if current and used + n > max_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += int(n)
    return batches + [current] if current else batches


def make_batch(ids: list[np.ndarray]):
    from megascore.api.types import ScoreBatch

    return ScoreBatch(
        token_ids=np.concatenate(ids),
        lengths=np.array([len(x) for x in ids], dtype=np.int64),
        losses=("nll",),
    )


def run_packed(engine, seqs, lengths, max_tokens, mem) -> tuple[float, int, list[np.ndarray]]:
    """Returns (seconds, peak bytes, per-sequence logprobs)."""
    out = [None] * len(seqs)
    mem.start()
    start = time.perf_counter()
    for idx in token_budget_batches(lengths, max_tokens):
        res = engine.score(make_batch([seqs[i] for i in idx]))
        parts = np.split(res.logprobs, np.cumsum([len(seqs[i]) for i in idx])[:-1])
        for i, lp in zip(idx, parts, strict=True):
            out[i] = lp
    return time.perf_counter() - start, mem.stop(), out


@torch.no_grad()
def run_padded(model, seqs, batch_size, device, mem) -> tuple[float, int, list[np.ndarray]]:
    """Padded baseline: [B, S] with pad 0 after each sequence, full-vocab log_softmax."""
    out = []
    mem.start()
    start = time.perf_counter()
    for b in range(0, len(seqs), batch_size):
        rows = seqs[b : b + batch_size]
        width = max(len(r) for r in rows)
        # ids: [B, S]
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.from_numpy(r)
        ids = ids.to(device)
        pos = torch.arange(width, device=device).expand(len(rows), width)
        logits = model(input_ids=ids, position_ids=pos, attention_mask=None)  # [B, S, V]
        lsm = torch.log_softmax(logits.float(), dim=-1)
        # lp: [B, S-1], log p(x_t | x_<t) for t >= 1
        lp = lsm[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1).cpu().numpy()
        for i, r in enumerate(rows):
            out.append(np.concatenate([[0.0], lp[i, : len(r) - 1]]).astype(np.float32))
        del logits, lsm
    return time.perf_counter() - start, mem.stop(), out


def linear_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    slope, intercept = np.polyfit(x, y, 1)
    pred = slope * x + intercept
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return float(slope), float(intercept), r2


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])

    from megascore.config import EngineConfig
    from megascore.engine.runtime import DistributedEngine

    engine = DistributedEngine.create(
        EngineConfig(
            model="bench",
            device=args.device,
            logprob_chunk_tokens=args.chunk_tokens,
            prefix_cache=False,  # repeated passes: their computation, not the cache
        )
    )
    try:
        info = engine.info()
        model, device = engine.loaded.model, engine.device
        mem = PeakMemory(device)
        lengths = length_mix(args)
        rng = np.random.default_rng(args.seed + 1)
        seqs = [rng.integers(0, info.vocab_size, n).astype(np.int64) for n in lengths]
        print(
            f"model bench: {info.num_parameters / 1e6:.1f}M params, vocab {info.vocab_size}, "
            f"{device}, fp32, torch threads {torch.get_num_threads()}"
        )
        print(
            f"length mix: {len(lengths)} sequences, {int(lengths.sum())} tokens, "
            f"min {lengths.min()} median {int(np.median(lengths))} max {lengths.max()}"
        )
        engine.score(make_batch([seqs[0][:16]]))  # warm-up

        t_pk, m_pk, lp_pk = run_packed(engine, seqs, lengths, args.max_tokens, mem)
        t_pd, m_pd, lp_pd = run_padded(model, seqs, args.batch_size, device, mem)
        real = int(lengths.sum())
        padded_tokens = sum(
            len(seqs[b : b + args.batch_size]) * max(lengths[b : b + args.batch_size])
            for b in range(0, len(seqs), args.batch_size)
        )
        diff = max(float(np.abs(a - b).max()) for a, b in zip(lp_pk, lp_pd, strict=True))
        print(f"\n{'':24}{'packed':>14}{'padded':>14}{'packed/padded':>16}")
        print(f"{'tokens computed':24}{real:>14}{padded_tokens:>14}{real / padded_tokens:>16.2f}")
        print(f"{'seconds':24}{t_pk:>14.2f}{t_pd:>14.2f}{t_pk / t_pd:>16.2f}")
        tps_pk, tps_pd = real / t_pk, real / t_pd
        print(f"{'real tokens / s':24}{tps_pk:>14.1f}{tps_pd:>14.1f}{tps_pk / tps_pd:>16.2f}")
        print(
            f"{'peak memory (MiB)':24}{m_pk / 2**20:>14.1f}{m_pd / 2**20:>14.1f}"
            f"{m_pk / max(m_pd, 1):>16.2f}"
        )
        print(f"max |logprob packed - padded| = {diff:.2e}")

        sizes = [int(x) for x in args.sweep.split(",")]
        peaks = []
        for size in sizes:
            n = max(1, size // args.sweep_seq_len)
            ids = [rng.integers(0, info.vocab_size, size // n).astype(np.int64) for _ in range(n)]
            mem.start()
            engine.score(make_batch(ids))
            peaks.append(mem.stop())
        slope, intercept, r2 = linear_fit(np.array(sizes, float), np.array(peaks, float))
        logits_per_token = info.vocab_size * 4  # fp32 full-vocabulary logits of one token
        print(f"\npacked peak memory vs tokens per batch (logprob chunks of {args.chunk_tokens})")
        for size, peak in zip(sizes, peaks, strict=True):
            chunks = -(-size // args.chunk_tokens)
            print(f"{size:>8} tokens {chunks:>3} chunk(s) {peak / 2**20:>10.1f} MiB")
        print(
            f"linear fit: {slope / 1024:.1f} KiB/token + {intercept / 2**20:.1f} MiB "
            f"(R^2 {r2:.3f}); full-vocab fp32 logits alone are "
            f"{logits_per_token / 1024:.1f} KiB/token (slope / that = "
            f"{slope / logits_per_token:.2f}), one chunk of them "
            f"{args.chunk_tokens * logits_per_token / 2**20:.1f} MiB"
        )
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()

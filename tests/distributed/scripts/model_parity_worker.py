"""Four-rank gloo run of build_model + tests/packed_forward in several parallel layouts.

Run by tests/distributed/test_model_parity.py under torchrun (--nproc-per-node 4).
For every layout each rank packs the same batch for its own CP rank, runs the
forward, gathers the vocab shards (TP) and the token shards (CP), and writes
``OUT_DIR/{layout}.rank{r}.npz``: float64 log-softmax over the full vocabulary at
the real tokens of every sequence plus the MoE / MTP metrics as scalars. The
first two layouts (TP = CP = EP = 1) are the single-rank references.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megascore.config import EngineConfig
from megascore.model.build import build_model
from megascore.model.config import builtin_model
from megascore.model.parallel import destroy_parallel, initialize_parallel
from tests.packed_forward import forward_packed, full_logits, pack_for_rank

# name: (model, tp, cp, ep, sequence_parallel, per-sequence pad multiple)
LAYOUTS = {
    "ref_tiny": ("tiny", 1, 1, 1, False, 1),
    "ref_tiny_moe": ("tiny-moe", 1, 1, 1, False, 1),
    "ref_tiny_moe_pad4": ("tiny-moe", 1, 1, 1, False, 4),
    "tp2": ("tiny", 2, 1, 1, False, 1),
    "cp2": ("tiny", 1, 2, 1, False, 4),
    "tp2_cp2": ("tiny", 2, 2, 1, False, 4),
    "ep2_moe": ("tiny-moe", 1, 1, 2, False, 1),
    "tp2_sp_ep2_moe": ("tiny-moe", 2, 1, 2, True, 4),
    "cp2_moe": ("tiny-moe", 1, 2, 1, False, 4),
    "dp4_split_moe": ("tiny-moe", 1, 1, 1, False, 1),
}
# Layouts whose DP ranks score different sequences of the batch (rank r: sequences
# r, r + DP, ...): only their step-level metrics are compared, with the whole batch's.
DP_SPLIT = {"dp4_split_moe"}
LENGTHS = [13, 1, 6, 2, 9]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ids ``[T]`` of the sequences concatenated, and their lengths."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 512, (sum(LENGTHS),), generator=gen)
    return ids, torch.tensor(LENGTHS)


def run_layout(name: str, out_dir: Path) -> None:
    model_name, tp, cp, ep, sp, pad_multiple = LAYOUTS[name]
    engine_cfg = EngineConfig(
        model=model_name,
        device="cpu",
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        sequence_parallel=sp,
    )
    pgs = initialize_parallel(engine_cfg)
    try:
        model_cfg = builtin_model(model_name)
        model = build_model(model_cfg, engine_cfg, pgs)
        ids, lens = batch()
        split = name in DP_SPLIT
        if split:  # this DP rank's sequences
            part = torch.arange(pgs.dp.rank(), len(LENGTHS), pgs.dp.size())
            ids = torch.cat([s for i, s in enumerate(ids.split(LENGTHS)) if i in part])
            lens = lens[part]
        packed = pack_for_rank(ids, lens, pgs, pad_multiple)
        out = forward_packed(
            model,
            packed,
            return_moe_metrics=model_cfg.is_moe,
            return_mtp_metrics=model_cfg.has_mtp,
            data_parallel_split=split,
        )
        full = full_logits(out, packed, pgs)  # [T, V], a tiny batch
        starts = packed.cu_seqlens_padded.tolist()
        rows = torch.cat(
            [torch.arange(s, s + n) for s, n in zip(starts, lens.tolist(), strict=False)]
        )
        logprobs = torch.log_softmax(full[rows].double(), dim=-1)
        metrics = {
            f"metric.{k}": np.float64(v) for k, v in {**out.moe_metrics, **out.mtp_metrics}.items()
        }
        np.savez(
            out_dir / f"{name}.rank{dist.get_rank()}.npz", logprobs=logprobs.numpy(), **metrics
        )
    finally:
        destroy_parallel()


def main() -> int:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    failed = False
    for name in LAYOUTS:
        try:
            run_layout(name, out_dir)
        except Exception:  # report and go on: the other layouts still run in step
            failed = True
            (out_dir / f"{name}.rank{dist.get_rank()}.error").write_text(traceback.format_exc())
            traceback.print_exc()
        dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

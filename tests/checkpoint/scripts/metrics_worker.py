"""torchrun worker (2 gloo ranks) for tests/checkpoint/test_family_metrics.py.

``WORK/hf_<family>/`` holds a tiny MoE checkpoint per family. For every family and
layout the worker loads the checkpoint, runs ``forward_packed`` (tests/packed_forward.py)
with the MoE and MTP metrics on one batch packed with the layout's per-sequence pad
multiple, and rank r writes ``OUT/<family>.<layout>.rank<r>.npz`` (target logprobs of
the real tokens and the metrics) or ``.error``.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

# layout -> (tp, cp, ep, sequence_parallel, per-sequence pad multiple); world size 2
# (tp = cp = ep = 1: two data-parallel ranks scoring the same batch)
LAYOUTS = {
    "ref": (1, 1, 1, False, 1),
    "ref_pad4": (1, 1, 1, False, 4),
    "cp2": (1, 2, 1, False, 4),
    "tp2_sp": (2, 1, 1, True, 4),
    "ep2": (1, 1, 2, False, 1),
}
LENGTHS = [13, 1, 6, 2, 9, 20]


def run(work: Path, out: Path, family: str, layout: str) -> None:
    from megascore.checkpoint import resolve_model
    from megascore.config import EngineConfig
    from megascore.model.build import build_model
    from megascore.model.parallel import destroy_parallel, initialize_parallel
    from tests.packed_forward import forward_packed, full_logits, pack_for_rank

    tp, cp, ep, sp, pad = LAYOUTS[layout]
    engine_cfg = EngineConfig(
        device="cpu",
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        sequence_parallel=sp,
    )
    pgs = initialize_parallel(engine_cfg)
    try:
        cfg, load, _ = resolve_model(f"hf:{work / f'hf_{family}'}")
        model = build_model(cfg, engine_cfg, pgs)
        load(model)
        gen = torch.Generator().manual_seed(11)
        ids = torch.randint(0, cfg.vocab_size, (sum(LENGTHS),), generator=gen)  # flat
        packed = pack_for_rank(ids, LENGTHS, pgs, pad)
        res = forward_packed(model, packed, return_moe_metrics=True, return_mtp_metrics=cfg.has_mtp)
        full = full_logits(res, packed, pgs)  # [T, V]
        starts = packed.cu_seqlens_padded.tolist()
        rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, LENGTHS, strict=False)])
        lp = torch.log_softmax(full[rows].double(), -1)
        metrics = {
            f"metric.{k}": np.float64(v) for k, v in {**res.moe_metrics, **res.mtp_metrics}.items()
        }
        path = out / f"{family}.{layout}.rank{dist.get_rank()}.npz"
        np.savez(path, logprobs=lp.numpy(), **metrics)
    finally:
        destroy_parallel()


def main() -> int:
    work, out, families = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(",")
    dist.init_process_group("gloo")
    failed = False
    for family in families:
        for layout in LAYOUTS:
            try:
                run(work, out, family, layout)
            except Exception:  # report and go on: the other layouts still run in step
                failed = True
                err = out / f"{family}.{layout}.rank{dist.get_rank()}.error"
                err.write_text(traceback.format_exc())
                traceback.print_exc()
            dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

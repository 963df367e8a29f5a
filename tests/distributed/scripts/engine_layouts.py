"""Parallel layouts of DistributedEngine in one 4-rank gloo launch.

The script initialises torch.distributed itself, so every layout re-initialises
only Megatron's parallel state (``DistributedEngine.create`` / ``shutdown``).
For each layout rank 0 scores the edge-case batch and writes
``OUT_DIR/<layout>.npz/.json``; the test compares them with the TP=1 reference
layout (and the world-size-1 launch). Layouts with world 4 and TP x CP < 4 have
data-parallel ranks: each scores its own part of the batch
(``megascore.engine.schedule.data_parallel``), and rank 0 joins the parts.

Then the failure paths: a worker that reports a failed step, and a worker that
hangs past the status timeout. Check outcomes: ``OUT_DIR/layouts_rank{r}.json``.
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from engine_common import (
    CheckLog,
    edge_case_batch,
    exit_without_teardown,
    expect_injected_failure,
    expect_worker_lost,
    layout_config,
    raise_after,
    save_output,
    stall_before,
)

from megascore.api import schema
from megascore.api.errors import InvalidRequestError, WorkerLostError
from megascore.config import EngineConfig
from megascore.engine.outputs.logprobs import score_tokens
from megascore.engine.runtime import DistributedEngine
from megascore.engine.schedule import pipeline as pipeline_module
from megascore.engine.schedule import step as step_module

# name -> (model, tp, cp, ep, sequence_parallel, pad_to_multiple_of). sequence_parallel None
# is the engine's default: on for a MoE model with TP > 1 (Megatron's training-mode MoE
# forward, for the metrics, needs it), so "moe_tp2_ep2" runs with SP and returns metrics;
# "moe_tp2_ep2_nosp" disables it explicitly and must reject metric requests. MoE layouts
# whose pad multiple is 4 (CP=2; TP=2 with SP and pad_to_multiple_of=4) are compared with
# "moe_ref_pad4", which packs the same way (pads count in Megatron's MoE aux losses).
MASKED = ("tiny_tp2", "tiny_tp2_cp2")
"""Layouts that also score the batch with ``logprob_positions`` masked."""
LAYOUTS = {
    "tiny_ref": ("tiny", 1, 1, 1, None, 1),
    "tiny_tp2": ("tiny", 2, 1, 1, None, 1),
    "tiny_cp2": ("tiny", 1, 2, 1, None, 1),
    "tiny_tp2_cp2": ("tiny", 2, 2, 1, None, 1),
    "moe_ref": ("tiny-moe", 1, 1, 1, None, 1),
    "moe_ref_pad4": ("tiny-moe", 1, 1, 1, None, 4),
    "moe_tp2": ("tiny-moe", 2, 1, 1, None, 4),
    "moe_cp2": ("tiny-moe", 1, 2, 1, None, 1),
    "moe_ep2": ("tiny-moe", 1, 1, 2, None, 1),
    "moe_ep4": ("tiny-moe", 1, 1, 4, None, 1),
    "moe_cp2_ep2": ("tiny-moe", 1, 2, 2, None, 1),
    "moe_tp2_ep2": ("tiny-moe", 2, 1, 2, None, 4),
    "moe_tp2_ep2_nosp": ("tiny-moe", 2, 1, 2, False, 1),
}
# Layouts that also return the MoE / MTP metrics.
WITH_METRICS = {
    "moe_ref", "moe_ref_pad4", "moe_tp2", "moe_cp2", "moe_ep2", "moe_ep4", "moe_cp2_ep2",
    "moe_tp2_ep2",
}  # fmt: skip


def engine_config(model, tp, cp, ep, sp, pad=1, timeout=60.0) -> EngineConfig:
    return layout_config(
        model, tp, cp, ep, pad=pad, timeout=timeout, sequence_parallel=sp,
        logprob_chunk_tokens=100,  # several chunks per step
    )  # fmt: skip


def check_vocab_parallel_random_logits(tp_group):
    """score_tokens on a vocab shard == torch on the full logits (fp32 and tie-heavy bf16)."""
    tp_rank, tp_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    gen = torch.Generator().manual_seed(11)
    full = torch.randn(37, 512, generator=gen) * 4
    targets = torch.randint(0, 512, (37,), generator=gen)
    temps = torch.rand(37, generator=gen) + 0.5
    ties = (torch.randint(-6, 6, (37, 512), generator=gen).float() / 4).to(torch.bfloat16)
    width = 512 // tp_size
    for logits in (full, ties):
        local = logits[:, tp_rank * width : (tp_rank + 1) * width]
        got = score_tokens(
            local, targets, tp_group=tp_group, temperature=temps, top_k=64, chunk_tokens=5
        )
        ref = torch.log_softmax(logits.float() / temps[:, None], dim=-1)
        want_lp = ref.gather(-1, targets[:, None])[:, 0]
        torch.testing.assert_close(got.logprobs, want_lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(
            got.top_k_logprobs, torch.topk(ref, 64, dim=-1).values, rtol=0, atol=1e-5
        )
        # Layout-independent ids, ties included: same as the unsharded computation.
        single = score_tokens(logits, None, tp_group=None, temperature=temps, top_k=64)
        assert torch.equal(got.top_k_ids, single.top_k_ids)


def run_layout(name, spec, rank, out_dir, log) -> None:
    engine = DistributedEngine.create(engine_config(*spec))
    if spec[1] > 1 and name.startswith("tiny"):
        log.run(
            f"{name}:vocab_parallel_random_logits",
            check_vocab_parallel_random_logits,
            engine.groups.tp,
        )
    if rank != 0:
        engine.worker_loop()
        return
    try:
        if name == "moe_tp2_ep2_nosp":
            check_metrics_rejected_without_sp(engine)
        elif name == "moe_tp2_ep2":
            assert engine.sequence_parallel and engine.pad_multiple == 4, engine.pad_multiple
            assert engine.loaded.model.config.sequence_parallel
        batch = edge_case_batch(moe=name in WITH_METRICS)
        out = engine.score(batch)
        save_output(out_dir / name, out, num_parameters=engine.info().num_parameters)
        if name in MASKED:  # the output head only at the loss mask's rows
            masked = dataclasses.replace(batch, logprob_positions=schema.MASKED)
            save_output(out_dir / f"{name}_masked", engine.score(masked))
        if name == "tiny_tp2_cp2":
            engine.load_weights("builtin:tiny@7", "")
            save_output(out_dir / f"{name}_seed7", engine.score(batch))
    finally:
        engine.shutdown()


def check_metrics_rejected_without_sp(engine) -> None:
    """Rank 0, SP explicitly off: a metrics request fails validation, before any collective."""
    assert not engine.sequence_parallel and not engine.loaded.model.config.sequence_parallel
    try:
        engine.score(edge_case_batch(moe=True))
    except InvalidRequestError as e:
        assert "sequence_parallel" in str(e), str(e)
    else:
        raise AssertionError("metrics accepted for a MoE model at TP=2 with SP disabled")


def check_reported_failure(rank):
    """Rank 1 raises after its step collectives: everyone learns it from the status flags."""
    engine = DistributedEngine.create(engine_config("tiny", 2, 1, 1, False))
    failing = raise_after(pipeline_module.score_tokens)
    expect_injected_failure(
        engine, rank, pipeline_module, "score_tokens", failing,
        on_rank=1, batch=edge_case_batch(), match="ranks [1]",
    )  # fmt: skip


def check_hung_worker(rank):
    """Rank 1 stalls before the status all-reduce: rank 0 gives up after the status timeout."""
    engine = DistributedEngine.create(engine_config("tiny", 2, 1, 1, False, timeout=3.0))
    if rank == 1:  # 12 s > the status timeout (3 x 3 s)
        step_module.agree_on_status = stall_before(step_module.agree_on_status, 12.0)
    if rank == 0:
        elapsed = expect_worker_lost(lambda: engine.score(edge_case_batch()), "status")
        assert elapsed < 40, f"took {elapsed:.1f} s"
    elif rank == 1:
        try:
            engine.worker_loop()
        except WorkerLostError:
            pass
    else:
        expect_worker_lost(engine.worker_loop, "status")


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    log = CheckLog(out_dir / f"layouts_rank{rank}.json")
    for name, spec in LAYOUTS.items():
        log.run(f"{name}:run", run_layout, name, spec, rank, out_dir, log)
    log.run("reported_failure", check_reported_failure, rank)
    log.run("hung_worker", check_hung_worker, rank)
    exit_without_teardown()  # the process group is unusable after the hung-worker check


if __name__ == "__main__":
    main(Path(sys.argv[1]))

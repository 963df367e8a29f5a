"""MoE routing record / replay of DistributedEngine in parallel layouts (2 gloo ranks).

For every layout of ``tiny-moe`` (TP=1 reference, TP=2 with sequence parallelism,
TP=2 without it, CP=2, EP=2, PP=2 with 4 microbatches: one MoE layer per stage) rank 0
scores one batch recording the routing, then replays (the batch travels to the
workers through the broadcast protocol):

* its own routes: logprobs and top-k bit-identical to the recording forward;
* the reference layout's routes: logprobs within 1e-5 of the reference;
* other valid routes: logprobs change;
* its own routes in a metrics (training-mode) forward: logprobs within 1e-6.

Routes go to ``OUT_DIR/<layout>.npz`` (the test compares them across layouts);
check outcomes to ``OUT_DIR/routing_rank{r}.json``.
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist
from engine_common import CheckLog

from megascore.api.types import ScoreBatch
from megascore.config import EngineConfig
from megascore.engine.layout.microbatch_plan import split_microbatches
from megascore.engine.runtime import DistributedEngine

# name -> (tp, cp, ep, pp, sequence_parallel); None: the engine's default (on for MoE at
# TP > 1). PP = 2 runs 2 x PP = 4 microbatches per step.
LAYOUTS = {
    "ref": (1, 1, 1, 1, None),
    "tp2_sp": (2, 1, 1, 1, None),
    "tp2_nosp": (2, 1, 1, 1, False),
    "cp2": (1, 2, 1, 1, None),
    "ep2": (1, 1, 2, 1, None),
    "pp2": (1, 1, 1, 2, None),
}
# no sequence longer than a quarter of the tokens, so PP = 2 splits a step into 4 microbatches
LENGTHS = (1, 5, 30, 1, 17, 3, 2, 40, 9, 25, 33, 12, 28)
NUM_EXPERTS = 4


def make_batch() -> ScoreBatch:
    rng = np.random.default_rng(5)
    lengths = np.array(LENGTHS, dtype=np.int64)
    return ScoreBatch(
        token_ids=rng.integers(0, 512, int(lengths.sum())).astype(np.int64),
        lengths=lengths,
        top_k=4,
        return_routing=True,
    )


def other_routes(routes: np.ndarray) -> np.ndarray:
    """Valid routes that differ from ``routes`` for every token and layer."""
    return ((routes + 1) % NUM_EXPERTS).astype(np.int32)


def run_layout(name: str, spec, rank: int, out_dir: Path, reference: dict) -> None:
    tp, cp, ep, pp, sp = spec
    engine = DistributedEngine.create(
        EngineConfig(
            model="tiny-moe",
            tensor_model_parallel_size=tp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            pipeline_model_parallel_size=pp,
            sequence_parallel=sp,
            logprob_chunk_tokens=64,
            collective_timeout_s=60.0,
        )
    )
    if rank != 0:
        engine.worker_loop()
        return
    try:
        batch = make_batch()
        if pp > 1:
            ranges, _ = split_microbatches(batch.lengths, engine.pad_multiple, 2 * pp)
            assert len(ranges) == 2 * pp, ranges
        out = engine.score(batch)
        np.savez(out_dir / f"{name}.npz", routing=out.routing, logprobs=out.logprobs)
        if name == "ref":
            reference.update(routing=out.routing, logprobs=out.logprobs)

        again = engine.score(dataclasses.replace(batch, routing=out.routing))
        assert np.array_equal(again.logprobs, out.logprobs), "replay is not bit-identical"
        assert np.array_equal(again.top_k_logprobs, out.top_k_logprobs)
        assert np.array_equal(again.routing, out.routing)

        ref = engine.score(dataclasses.replace(batch, routing=reference["routing"]))
        np.testing.assert_allclose(ref.logprobs, reference["logprobs"], rtol=0, atol=1e-5)

        moved = engine.score(dataclasses.replace(batch, routing=other_routes(out.routing)))
        assert np.abs(moved.logprobs - out.logprobs).max() > 1e-3, "other routes changed nothing"

        if sp is not False or tp == 1:  # metrics of MoE at TP > 1 need SP
            metrics = dataclasses.replace(batch, routing=out.routing, return_moe_metrics=True)
            scored = engine.score(metrics)
            assert scored.moe_metrics
            np.testing.assert_allclose(scored.logprobs, out.logprobs, rtol=0, atol=1e-6)
    finally:
        engine.shutdown()


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    log = CheckLog(out_dir / f"routing_rank{rank}.json")
    reference: dict = {}
    for name, spec in LAYOUTS.items():
        log.run(name, run_layout, name, spec, rank, out_dir, reference)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

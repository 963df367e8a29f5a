"""torchrun script (2 gloo ranks) for tests/checkpoint/test_adapter_engine_layouts.py: served
LoRA adapters through ``DistributedEngine`` at TP2, PP2 and EP2.

Arguments: ``OUT WORK``. ``WORK`` holds ``hf_<family>/`` (the tiny HF checkpoints),
``ad_<case>/`` (the peft adapters of :data:`CASES`), ``ids.npy`` (the batch scored) and
``peft.npz`` (per case and ``base_<family>``: float64 ``[b, s-1]`` logprobs of
transformers + peft, written by the test). For each layout and family one engine is
started with the family's adapters (``EngineConfig.adapters``), the batch is scored under
each adapter and the base (a request naming it: ``ScoreBatch.model``) and rank 0 checks
each against peft (<= 1e-4, fp32). On llama (four adapters) it also scores five
sequences under four adapters and the base in one step (the per-sequence input
``adapter``, as the server's batcher merges requests) and checks each sequence equals
it scored alone, bit for bit (batch-invariant CPU defaults).

Check outcomes go to ``OUT/adapters_rank{r}.json`` (``engine_common.CheckLog``).
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist

from megascore.api.types import ScoreBatch
from megascore.config import EngineConfig
from megascore.engine.runtime import DistributedEngine
from tests.distributed.scripts.engine_common import CheckLog

TOL = 1e-4  # vs transformers + peft, float32
CASES = {  # family -> the adapter cases it serves (tests/checkpoint/test_lora.py PARITY)
    "llama": ("llama-r8", "llama-r16-rslora", "llama-qv-up", "llama-patterns"),
    "qwen3": ("qwen3-r8", "qwen3-r16-rslora"),
    "qwen3_moe": ("qwen3_moe-r8", "qwen3_moe-r16-rslora"),  # attention only: experts refused
}
LAYOUTS = {  # name -> (EngineConfig sizes, families)
    "tp2": (dict(tensor_model_parallel_size=2), ("llama", "qwen3", "qwen3_moe")),
    "pp2": (
        dict(pipeline_model_parallel_size=2, pipeline_microbatches=2),
        ("llama", "qwen3", "qwen3_moe"),
    ),
    "ep2": (dict(expert_model_parallel_size=2), ("qwen3_moe",)),
}
MIXED = ("llama-r8", "", "llama-r16-rslora", "llama-qv-up", "llama-patterns")  # "": base


def checks() -> list[str]:
    """Every check the script records, in order."""
    names = []
    for layout, (_, families) in LAYOUTS.items():
        for family in families:
            names.append(f"{layout}_{family}")
            if family == "llama":
                names.append(f"{layout}_{family}_mixed")
    return names


def _batch(ids: np.ndarray, **fields) -> ScoreBatch:
    return ScoreBatch(
        token_ids=ids.reshape(-1).astype(np.int64),
        lengths=np.full(ids.shape[0], ids.shape[1], dtype=np.int64),
        **fields,
    )


def _rows(logprobs, count: int) -> list[np.ndarray]:
    return np.split(np.asarray(logprobs, np.float64), count)


def _parity(engine, family: str, ids: np.ndarray, peft) -> None:
    """Each adapter and the base, requested by name = transformers + peft."""
    for case in ("", *CASES[family]):
        got = engine.score(_batch(ids, model=case)).logprobs
        want = peft[case or f"base_{family}"]
        for b, row in enumerate(_rows(got, len(ids))):
            assert row[0] == 0.0
            np.testing.assert_allclose(row[1:], want[b], rtol=0, atol=TOL, err_msg=f"{case} {b}")
    # an adapter that changes nothing would pass the above with the base: they differ
    assert not np.allclose(peft[CASES[family][0]], peft[f"base_{family}"], atol=1e-3)


def _mixed(engine, ids: np.ndarray) -> None:
    """Five sequences, four adapters and the base, in one step = each alone, bitwise."""
    alone = [
        engine.score(_batch(ids[i : i + 1], model=name)).logprobs for i, name in enumerate(MIXED)
    ]
    slots = [engine.sets.adapters[n].slot if n else -1 for n in MIXED]
    assert sorted(slots) == [-1, 0, 1, 2, 3], slots
    together = engine.score(_batch(ids, adapter=np.array(slots, np.int64))).logprobs
    for i, (row, want) in enumerate(zip(_rows(together, len(ids)), alone, strict=True)):
        np.testing.assert_array_equal(row, want, err_msg=f"sequence {i} ({MIXED[i] or 'base'})")
    assert not np.array_equal(alone[0], engine.score(_batch(ids[:1])).logprobs)


def run(work: Path, layout: str, family: str, rank: int, log: CheckLog) -> None:
    sizes, _ = LAYOUTS[layout]
    engine = DistributedEngine.create(
        EngineConfig(
            model=f"hf:{work / f'hf_{family}'}",
            adapters=tuple(f"{case}={work / f'ad_{case}'}" for case in CASES[family]),
            collective_timeout_s=60.0,
            **sizes,
        )
    )
    name = f"{layout}_{family}"
    if rank != 0:
        log.run(name, engine.worker_loop)  # serves until rank 0's shutdown
        if family == "llama":
            log.results[f"{name}_mixed"] = log.results[name]
            log.write()
        return
    try:
        peft = np.load(work / "peft.npz")
        log.run(name, _parity, engine, family, np.load(work / "ids.npy"), peft)
        if family == "llama":
            log.run(f"{name}_mixed", _mixed, engine, np.load(work / "mixed_ids.npy"))
    finally:
        engine.shutdown()


def main(out: Path, work: Path) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    log = CheckLog(out / f"adapters_rank{rank}.json")
    for layout, (_, families) in LAYOUTS.items():
        for family in families:
            run(work, layout, family, rank, log)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))  # OUT, WORK (tests.torchrun.run_check_script)

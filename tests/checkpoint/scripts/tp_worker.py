"""torchrun worker (2 gloo ranks) for tests/checkpoint/test_parallel_load.py.

``WORK`` holds ``hf_<family>/`` (HF checkpoints with ``reference.npy``) and
``mg_tp1_<family>/`` (Megatron checkpoints saved at TP=1 by the test). Phases:

* TP=2 (expert TP=2): load each HF checkpoint (every family), score; push the same
  checkpoint's transformers model's ``state_dict()`` (HF names, on rank 0; each rank receives only
  the parts it reads, ``WeightStaging.receive``) into a model of random weights and compare every
  parameter on each rank with the loaded one; save ``mg_tp2_<family>``;
  load ``mg_tp1_<family>`` and score; serve ``hf_llama`` and reload ``hf_llama_b`` into
  it through the engine's load paths (``load_served_model``, ``reload_served_model``)
  and score.
* TP=1, EP=2: the same for the MoE families (experts split 2 + 2).
* DistributedEngine at TP=2 serving ``hf:hf_llama``: score, LoadWeights
  ``megatron:mg_tp1_llama_b`` (RELOAD on both ranks), a refused reload (other
  architecture) that keeps the weights, and a reload back to ``hf_llama``.

Rank 0 writes ``out/<case>.npy``; any exception is written to ``out/<case>.error``
and re-raised so torchrun fails.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import numpy as np
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # testkit

from testkit.checkpoints import (  # noqa: E402
    FAMILIES,
    MOE_FAMILIES,
    MTP_FAMILIES,
    engine_logprobs,
    engine_on_rank0,
    make_hf_model,
    megatron_logprobs,
    token_batch,
)


def _record(out: Path, case: str, fn) -> None:
    try:
        value = fn()
    except Exception:
        (out / f"{case}.rank{dist.get_rank()}.error").write_text(traceback.format_exc())
        raise
    np.save(out / f"{case}.rank{dist.get_rank()}.npy", value)


def _phase(work: Path, out: Path, tag: str, engine_cfg, families: list[str]) -> None:
    from megascore.checkpoint import resolve_model
    from megascore.checkpoint.megatron_ckpt import save_checkpoint
    from megascore.engine.weights.served_model import load_served_model, reload_served_model
    from megascore.model.build import build_model
    from megascore.model.parallel import destroy_parallel, initialize_parallel

    pgs = initialize_parallel(engine_cfg)
    ids = token_batch()
    for family in families:
        cfg, load, _ = resolve_model(f"hf:{work / f'hf_{family}'}")
        model = build_model(cfg, engine_cfg, pgs)

        def from_hf(model=model, load=load):
            load(model)
            return megatron_logprobs(model, ids, pgs.tp)

        _record(out, f"hf_{tag}_{family}", from_hf)
        _record(
            out,
            f"push_{tag}_{family}",
            lambda family=family, cfg=cfg, model=model: _pushed_vs_loaded(
                family, cfg, engine_cfg, pgs, model
            ),
        )
        save_checkpoint(model, cfg, out / f"mg_{tag}_{family}")

        mg_cfg, mg_load, _ = resolve_model(f"megatron:{work / f'mg_tp1_{family}'}")
        mg_model = build_model(mg_cfg, engine_cfg, pgs)

        def from_megatron(mg_model=mg_model, mg_load=mg_load):
            mg_load(mg_model)
            return megatron_logprobs(mg_model, ids, pgs.tp)

        _record(out, f"mg_tp1_to_{tag}_{family}", from_megatron)
        if family == "llama":

            def reloaded():
                served = load_served_model(f"hf:{work / 'hf_llama'}", engine_cfg, pgs)
                new = reload_served_model(served, f"hf:{work / 'hf_llama_b'}", engine_cfg, pgs)
                return megatron_logprobs(new.model, ids, pgs.tp)

            _record(out, f"reload_{tag}_llama", reloaded)
    destroy_parallel()


def _pushed_vs_loaded(family: str, cfg, engine_cfg, pgs, loaded) -> np.ndarray:
    """Pushes the ``state_dict()`` of the transformers model the family's checkpoint was
    saved from (HF names; rank 0 holds the tensors, the other ranks a meta tensor of each
    one's shape, as from the protocol header) into a new model of random weights, partial
    when the checkpoint has MTP layers (transformers has none); returns ``[bytes this
    rank received, bytes pushed, pushed parameters that differ from loaded's]``."""
    import torch

    from megascore.api.types import WEIGHT_NAMES_HF
    from megascore.engine.weights.push.apply import (
        WeightStaging,
        gather_needs,
        gather_targets,
        weight_targets,
    )
    from megascore.model.build import build_model

    model = build_model(cfg, engine_cfg, pgs)
    group = dist.group.WORLD
    local = weight_targets(model, cfg, pgs, WEIGHT_NAMES_HF)
    targets = gather_targets(local, group, cfg, WEIGHT_NAMES_HF)
    staging = WeightStaging(model, cfg, pgs, WEIGHT_NAMES_HF)
    gather_needs(staging, group)
    total = 0
    for name, tensor in make_hf_model(family, 0).state_dict().items():
        if targets[name].ignored:
            continue
        total += tensor.numel() * tensor.element_size()
        if dist.get_rank() != 0:
            tensor = tensor.to("meta")
        staging.receive(name, tensor, targets[name].layout, group, 0)
    problem = staging.problem(partial=family in MTP_FAMILIES)
    assert problem is None, problem
    staging.apply()
    want = loaded.state_dict()
    differ = [n for n in staging.staged if not torch.equal(staging.params[n], want[n])]
    return np.array([staging.received_bytes, total, len(differ)])


def _engine_phase(work: Path, out: Path) -> None:
    from megascore.api.errors import CheckpointError

    engine = engine_on_rank0(f"hf:{work / 'hf_llama'}", tensor_model_parallel_size=2)
    if engine is None:
        return
    ids = token_batch()

    def score() -> np.ndarray:
        return engine_logprobs(engine, ids)

    info = engine.info()
    versions = {"start": info.weights_version, "name": info.name}
    np.save(out / "engine_hf.npy", score())
    versions["megatron"] = engine.load_weights(f"megatron:{work / 'mg_tp1_llama_b'}", "")
    np.save(out / "engine_mg_b.npy", score())
    try:
        engine.load_weights(f"hf:{work / 'hf_qwen2'}", "")
        versions["refused"] = "no error"
    except CheckpointError as e:
        versions["refused"] = str(e)
    versions["after_refused"] = engine.info().weights_version
    np.save(out / "engine_after_refused.npy", score())
    versions["back"] = engine.load_weights(f"hf:{work / 'hf_llama'}", "v-back")
    np.save(out / "engine_back.npy", score())
    (out / "engine.json").write_text(json.dumps(versions))
    engine.shutdown()


def main() -> None:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    from megascore.config import EngineConfig

    tp2 = EngineConfig(device="cpu", tensor_model_parallel_size=2)
    _phase(work, out, "tp2", tp2, list(FAMILIES))
    ep2 = EngineConfig(device="cpu", expert_model_parallel_size=2)
    _phase(work, out, "ep2", ep2, list(MOE_FAMILIES))
    _engine_phase(work, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

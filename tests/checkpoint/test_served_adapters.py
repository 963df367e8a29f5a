"""LoRA adapters served by one engine (docs/engine.md "LoRA adapters"), one gloo rank.

A tiny llama ``hf:`` checkpoint with four peft adapters loaded at start-up
(``EngineConfig.adapters``): a request naming one = transformers + peft (<= 1e-4, fp32);
a step whose sequences carry four adapters and the base (the input ``adapter``, as the
batcher merges requests) = each alone, bit for bit; the broadcast and the data-parallel
split carry the per-sequence slots; a push of an adapter's tensors = the same tensors
loaded from a directory (bitwise); the reference KL with the base; unknown names.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from megascore.api.errors import CheckpointError, InvalidRequestError, NotFoundError
from megascore.api.types import ScoreBatch
from megascore.config import EngineConfig
from megascore.engine.runtime import DistributedEngine
from megascore.engine.schedule.data_parallel import sub_batch
from testkit.checkpoints import token_batch, write_hf_checkpoint
from tests.checkpoint.lora_cases import FOUR as LORAS
from tests.checkpoint.lora_cases import peft_model, write_adapter
from tests.one_rank import one_rank_world

TOL = 1e-4


def _batch(ids) -> ScoreBatch:
    return ScoreBatch(
        token_ids=ids.reshape(-1).numpy().astype(np.int64),
        lengths=np.full(ids.shape[0], ids.shape[1], dtype=np.int64),
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Everything the tests check, from one engine."""
    root = tmp_path_factory.mktemp("adapters")
    write_hf_checkpoint("llama", root / "base")
    ids = token_batch(batch=2)
    want, dirs = {}, {}
    for name, (seed, lora) in LORAS.items():
        dirs[name] = root / name
        want[name], want["base"] = write_adapter("llama", dirs[name], ids, seed, **lora)
    pushed = peft_model("llama", 9, **LORAS["a"][1])
    pushed.save_pretrained(root / "pushed")
    cfg = EngineConfig(
        model=f"hf:{root / 'base'}",
        device="cpu",
        collective_timeout_s=60,
        adapters=tuple(f"{n}={d}" for n, d in dirs.items()),
    )
    got = {"want": want}
    with one_rank_world():
        engine = DistributedEngine.create(cfg)
        got["alone"] = {n: engine.score(dataclasses.replace(_batch(ids), model=n)) for n in dirs}
        got["alone"]["base"] = engine.score(_batch(ids))
        mixed_ids = token_batch(seed=1, batch=5)
        got["mixed_alone"] = [
            engine.score(dataclasses.replace(_batch(mixed_ids[i : i + 1]), model=n)).logprobs
            for i, n in enumerate(["a", "", "b", "c", "d"])
        ]
        slots = [engine.sets.adapters[n].slot if n else -1 for n in ["a", "", "b", "c", "d"]]
        mixed = dataclasses.replace(_batch(mixed_ids), adapter=np.array(slots, np.int64))
        got["mixed"] = engine.score(mixed).logprobs
        got["slots"] = slots
        got["kl"] = engine.score(dataclasses.replace(_batch(ids), model="a", reference="default"))
        got["info"] = engine.info()
        for bad in (dict(model="nope"), dict(reference="gone")):
            with pytest.raises(NotFoundError):
                engine.score(dataclasses.replace(_batch(ids), **bad))
        with pytest.raises(InvalidRequestError, match="sequence 1"):
            engine.score(dataclasses.replace(mixed, adapter=np.array([0, 7, 0, 0, 0])))
        with pytest.raises(CheckpointError):
            engine.load_adapter("e", str(root / "missing"))
        got["versions"] = {"before": engine.sets.adapters["a"].weights_version}
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(pushed)
        config = json.dumps(pushed.peft_config["default"].to_dict(), default=sorted)
        targets = engine.begin_adapter_push("a", config)
        assert set(state) <= set(targets)
        for key, tensor in state.items():
            assert targets[key].shape == tuple(tensor.shape), key
            data = bytearray(tensor.contiguous().numpy().tobytes())
            engine.stage_weight(key, "float32", tuple(tensor.shape), data, 0)
        got["versions"]["pushed"] = engine.commit_weights("a-1", False)
        got["pushed"] = engine.score(dataclasses.replace(_batch(ids), model="a")).logprobs
        engine.load_adapter("a", str(root / "pushed"))
        got["loaded"] = engine.score(dataclasses.replace(_batch(ids), model="a")).logprobs
        engine.shutdown()
    return got


def _rows(logprobs, lengths):
    return np.split(np.asarray(logprobs, np.float64), np.cumsum(lengths)[:-1])


def test_an_adapter_named_by_a_request_equals_peft(served):
    for name in [*LORAS, "base"]:
        rows = _rows(served["alone"][name].logprobs, [20, 20])
        for row, want in zip(rows, served["want"][name], strict=True):
            np.testing.assert_allclose(row[1:], want, rtol=0, atol=TOL, err_msg=name)
    assert not np.allclose(served["want"]["a"], served["want"]["base"], atol=1e-3)


def test_a_step_mixing_four_adapters_and_the_base_equals_each_alone(served):
    assert sorted(served["slots"]) == [-1, 0, 1, 2, 3]
    rows = _rows(served["mixed"], [20] * 5)
    for row, alone in zip(rows, served["mixed_alone"], strict=True):
        np.testing.assert_array_equal(row, alone)


def test_the_reference_of_an_adapter_request_is_the_base(served):
    kl = served["kl"]
    np.testing.assert_array_equal(kl.reference_logprobs, served["alone"]["base"].logprobs)
    np.testing.assert_array_equal(kl.logprobs, served["alone"]["a"].logprobs)
    r = kl.reference_logprobs.astype(np.float64) - kl.logprobs.astype(np.float64)
    for start in (0, 20):
        r[start] = 0.0
    np.testing.assert_allclose(kl.kl_k3, np.expm1(r) - r, rtol=0, atol=1e-12)


def test_the_served_names_list_the_adapters_over_their_set(served):
    models = served["info"].models
    assert [m.name for m in models] == ["default", *LORAS]
    assert all(m.base == "default" and m.weights_version.startswith("adapter-") for m in models[1:])


def test_a_pushed_adapter_equals_the_same_tensors_loaded(served):
    assert served["versions"]["pushed"] == "a-1"
    np.testing.assert_array_equal(served["pushed"], served["loaded"])
    assert not np.array_equal(served["pushed"], served["alone"]["a"].logprobs)


def test_the_data_parallel_split_carries_the_slots():
    batch = ScoreBatch(
        token_ids=np.arange(10, dtype=np.int64),
        lengths=np.array([3, 3, 4], dtype=np.int64),
        adapter=np.array([2, -1, 0], dtype=np.int64),
    )
    part = sub_batch(batch, np.array([2, 0]))
    np.testing.assert_array_equal(part.adapter, [0, 2])

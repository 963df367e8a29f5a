"""Named weight sets on one engine (docs/engine.md "Weight sets"), one gloo rank.

A ``reference`` and a ``policy`` set, both the initial weights (``builtin:tiny@1``), under
each memory policy: five pushes to ``policy`` leave ``reference`` scoring bit for bit as a
fresh engine on the initial weights, and ``policy`` as the last pushed weights; host
sets give the same bits as resident ones; a request naming both gets the reference's
logprobs and the KL estimators of numpy on the two sets' logprobs (<= 1e-12, float64);
unknown names are NotFoundError before any collective; a pin names a set's version.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megascore.api.errors import NotFoundError, WrongVersionError
from megascore.api.types import LAYOUT_COMMON, WEIGHT_NAMES_MEGATRON, ScoreBatch
from megascore.config import EngineConfig
from megascore.engine.runtime import DistributedEngine
from tests.one_rank import one_rank_world

BATCH = ScoreBatch(
    token_ids=np.random.default_rng(0).integers(0, 500, 40).astype(np.int64),
    lengths=np.array([7, 33], dtype=np.int64),
    loss_mask=(np.arange(40) % 3 > 0).astype(np.uint8),
)
SETS = ("reference=builtin:tiny@1", "policy=builtin:tiny@1")
PUSHES = 5


def _config(**kw) -> EngineConfig:
    return EngineConfig(device="cpu", collective_timeout_s=60, **kw)


def _push(engine, state: dict[str, torch.Tensor], version: str) -> str:
    engine.begin_weight_update(WEIGHT_NAMES_MEGATRON, "policy")
    for name, tensor in state.items():
        data = bytearray(tensor.contiguous().numpy().tobytes())
        engine.stage_weight(name, "float32", tuple(tensor.shape), data, LAYOUT_COMMON)
    return engine.commit_weights(version, False)


def _run(policy: str) -> dict:
    """Everything the tests check, from one engine of ``policy`` (one gloo world at a time)."""
    got = {}
    with one_rank_world():
        engine = DistributedEngine.create(_config(weights=SETS, weight_sets=policy))
        initial = engine.loaded.model.state_dict()
        state = {k: v.clone() for k, v in initial.items() if not k.endswith("_extra_state")}
        got["before"] = engine.score(dataclasses.replace(BATCH, model="policy")).logprobs
        rng = torch.Generator().manual_seed(7)
        for i in range(PUSHES):
            for tensor in state.values():
                tensor.add_(0.01 * torch.randn(tensor.shape, generator=rng))
            got["version"] = _push(engine, state, f"policy-{i}")
        got["pushed"] = {k: v.clone() for k, v in state.items()}
        got["reference"] = engine.score(dataclasses.replace(BATCH, model="reference"))
        got["default"] = engine.score(BATCH)
        got["policy"] = engine.score(dataclasses.replace(BATCH, model="policy"))
        got["both"] = engine.score(
            dataclasses.replace(BATCH, model="policy", reference="reference")
        )
        got["info"] = engine.info()
        for field, value in (("model", "nope"), ("reference", "gone")):
            with pytest.raises(NotFoundError, match=f"options.{field}.*{value}"):
                engine.score(dataclasses.replace(BATCH, **{field: value}))
        with pytest.raises(NotFoundError, match="weight_set"):
            engine.load_weights("builtin:tiny@3", "", "nope")
        pinned = dataclasses.replace(BATCH, model="policy", weights_version=got["version"])
        got["pinned"] = engine.score(pinned).logprobs
        with pytest.raises(WrongVersionError):
            engine.score(dataclasses.replace(pinned, model="reference"))
        engine.shutdown()
    return got


@pytest.fixture(scope="module")
def fresh() -> dict:
    """A fresh one-set engine's output on the initial weights."""
    with one_rank_world():
        engine = DistributedEngine.create(_config(model="builtin:tiny@1"))
        initial = engine.score(BATCH)
        engine.shutdown()
    return {"initial": initial}


@pytest.fixture(scope="module", params=["resident", "host"])
def sets(request) -> dict:
    return _run(request.param)


@pytest.fixture(scope="module")
def host_and_resident() -> tuple[dict, dict]:
    return _run("resident"), _run("host")


def test_the_reference_is_untouched_by_five_pushes_to_the_policy(sets, fresh):
    np.testing.assert_array_equal(sets["reference"].logprobs, fresh["initial"].logprobs)
    np.testing.assert_array_equal(sets["default"].logprobs, fresh["initial"].logprobs)
    np.testing.assert_array_equal(sets["before"], fresh["initial"].logprobs)
    assert sets["reference"].weights_version == "builtin:tiny@1"
    assert sets["policy"].weights_version == sets["version"] == f"policy-{PUSHES - 1}"
    assert not np.array_equal(sets["policy"].logprobs, fresh["initial"].logprobs)
    names = [(m.name, m.weights_version) for m in sets["info"].models]
    assert names == [("reference", "builtin:tiny@1"), ("policy", f"policy-{PUSHES - 1}")]
    np.testing.assert_array_equal(sets["pinned"], sets["policy"].logprobs)


def test_the_policy_scores_as_a_fresh_engine_on_the_pushed_weights(sets):
    with one_rank_world():
        engine = DistributedEngine.create(_config(model="builtin:tiny@1"))
        engine.begin_weight_update(WEIGHT_NAMES_MEGATRON)
        for name, tensor in sets["pushed"].items():
            data = bytearray(tensor.contiguous().numpy().tobytes())
            engine.stage_weight(name, "float32", tuple(tensor.shape), data, LAYOUT_COMMON)
        engine.commit_weights("pushed", False)
        alone = engine.score(BATCH)
        engine.shutdown()
    np.testing.assert_array_equal(sets["policy"].logprobs, alone.logprobs)


def test_host_sets_give_the_bits_of_resident_ones(host_and_resident):
    resident, host = host_and_resident
    for key in ("reference", "policy", "both"):
        for name, value in resident[key].values.items():
            other = host[key].values[name]
            if isinstance(value, dict):
                for k in value:
                    np.testing.assert_array_equal(value[k], other[k], err_msg=f"{key} {name}")
            else:
                np.testing.assert_array_equal(value, other, err_msg=f"{key} {name}")


def test_the_kl_estimators_are_numpys_on_the_two_sets_logprobs(sets):
    both = sets["both"]
    np.testing.assert_array_equal(both.logprobs, sets["policy"].logprobs)
    np.testing.assert_array_equal(both.reference_logprobs, sets["reference"].logprobs)
    p = sets["policy"].logprobs.astype(np.float64)
    q = sets["reference"].logprobs.astype(np.float64)
    r = q - p
    first = np.zeros(BATCH.num_tokens, bool)
    first[[0, 7]] = True
    expected = {"k1": p - q, "k2": 0.5 * r**2, "k3": np.exp(r) - r - 1}
    mask = BATCH.loss_mask.astype(bool) & ~first
    starts = (0, 7)
    for name, values in expected.items():
        values = np.where(first, 0.0, values)
        got = getattr(both, f"kl_{name}")
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, values, rtol=0, atol=1e-12, err_msg=name)
        means = [
            values[s : s + n][mask[s : s + n]].mean() for s, n in zip(starts, (7, 33), strict=True)
        ]
        np.testing.assert_allclose(both.kl[name], means, rtol=0, atol=1e-12, err_msg=name)
    assert both.weights_version == sets["version"]

"""Weight pushes through the real engine on one gloo rank (``DistributedEngine``).

A full Megatron-name push of another seed's weights makes the engine score exactly like
an engine built with that seed, under the pushed version, and scoring between the
staged tensors still uses the old weights. The next push stages into the memory the
last one freed (the replaced parameters' values): the parameters alternate between two
sets of buffers, and score the pushed weights each time. A push whose model was swapped by
``LoadWeights`` before its commit is refused (FAILED_PRECONDITION's CheckpointError)
and the loaded weights stay, under their own version.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megascore.api.errors import CheckpointError
from megascore.api.types import LAYOUT_COMMON, WEIGHT_NAMES_MEGATRON, ScoreBatch
from megascore.config import EngineConfig
from megascore.engine.runtime import DistributedEngine
from megascore.engine.weights.push.apply import WeightStaging
from tests.one_rank import one_rank_world

BATCH = ScoreBatch(
    token_ids=np.random.default_rng(0).integers(0, 500, 40).astype(np.int64),
    lengths=np.array([7, 33], dtype=np.int64),
)


@pytest.fixture(scope="module")
def engine():
    with one_rank_world():
        eng = DistributedEngine.create(
            EngineConfig(model="builtin:tiny@1", device="cpu", collective_timeout_s=60)
        )
        yield eng
        eng.shutdown()


def _state(engine) -> dict[str, torch.Tensor]:
    sd = engine.loaded.model.state_dict()
    return {k: v.clone() for k, v in sd.items() if not k.endswith("_extra_state")}


def _push(engine, state, version, between=None):
    engine.begin_weight_update(WEIGHT_NAMES_MEGATRON)
    for i, (name, tensor) in enumerate(state.items()):
        data = bytearray(tensor.contiguous().numpy().tobytes())
        engine.stage_weight(name, "float32", tuple(tensor.shape), data, LAYOUT_COMMON)
        if i == 3 and between is not None:
            between()
    return engine.commit_weights(version, False)


def test_push_scores_like_the_pushed_weights(engine):
    engine.load_weights("builtin:tiny@1", "")  # what the module's other tests pushed goes
    old = engine.score(BATCH)
    engine.load_weights("builtin:tiny@2", "")
    target = engine.score(BATCH)
    seed2 = _state(engine)
    engine.load_weights("builtin:tiny@1", "")
    assert np.abs(target.logprobs - old.logprobs).max() > 1e-3

    def score_old():  # staged tensors are not served yet
        assert np.array_equal(engine.score(BATCH).logprobs, old.logprobs)

    assert _push(engine, seed2, "pushed-2", between=score_old) == "pushed-2"
    out = engine.score(BATCH)
    assert out.weights_version == engine.info().weights_version == "pushed-2"
    assert np.array_equal(out.logprobs, target.logprobs)


def _addresses(engine) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in _state_refs(engine).items()}


def _state_refs(engine) -> dict[str, torch.Tensor]:
    sd = engine.loaded.model.state_dict(keep_vars=True)
    return {k: v for k, v in sd.items() if not k.endswith("_extra_state")}


def test_a_push_stages_into_the_memory_the_last_one_freed(engine):
    seeds = {}
    for seed in (4, 5):
        engine.load_weights(f"builtin:tiny@{seed}", "")
        seeds[seed] = (_state(engine), engine.score(BATCH).logprobs)
    engine.load_weights("builtin:tiny@1", "")
    _push(engine, seeds[4][0], "p4")
    first = _addresses(engine)
    _push(engine, seeds[5][0], "p5")
    second = _addresses(engine)
    assert np.array_equal(engine.score(BATCH).logprobs, seeds[5][1])
    _push(engine, seeds[4][0], "p4-again")
    assert _addresses(engine) == first  # the buffers the second push freed
    assert np.array_equal(engine.score(BATCH).logprobs, seeds[4][1])
    assert not set(first.values()) & set(second.values())


def test_a_reload_during_a_push_wins(engine):
    state = _state(engine)

    def reload():
        engine.load_weights("builtin:tiny@3", "loaded-3")

    with pytest.raises(CheckpointError, match="reloaded"):
        _push(engine, state, "never", between=reload)
    assert engine.info().weights_version == "loaded-3"
    assert engine.score(BATCH).weights_version == "loaded-3"


def test_staging_runs_on_one_thread_and_scoring_keeps_the_pool(engine, monkeypatch):
    """A pushed tensor's copies run single-threaded (the pool's threads would spin after
    each, taking cores from the stream); the steps around them keep every thread."""
    seen = []
    receive = WeightStaging.receive

    def spy(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return receive(self, *args, **kwargs)

    monkeypatch.setattr(WeightStaging, "receive", spy)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:

        def score_between():
            assert torch.get_num_threads() == 2
            engine.score(BATCH)

        _push(engine, _state(engine), "one-thread", between=score_between)
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)

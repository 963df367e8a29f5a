"""Issue 20: LoadWeights writes the served parameters in place, through a one-rank engine.

The new weights land in the served parameters themselves (same tensors, no second model
built); a damaged checkpoint is refused before anything is written and the old weights
keep serving; a read that fails after the ranks agreed breaks the replica instead of
serving a mix of two checkpoints; a weight push open across a reload is refused at its
commit (the model object stays the same, the engine tells a reload apart all the same).
"""

from __future__ import annotations

import numpy as np
import pytest

from megascore.api.errors import CheckpointError, WorkerLostError
from megascore.api.types import WEIGHT_NAMES_MEGATRON
from megascore.checkpoint.safetensors_io import SafetensorsDir
from megascore.config import EngineConfig
from megascore.engine.runtime import DistributedEngine
from megascore.engine.weights import served_model
from testkit.checkpoints import engine_logprobs, token_batch
from tests.one_rank import one_rank_world

TOL = 1e-4


def _reference(directory) -> np.ndarray:
    return np.load(directory / "reference.npy")


@pytest.fixture
def engine(hf_dirs):
    """A one-rank CPU engine serving the llama checkpoint (its own: a test breaks it)."""
    with one_rank_world():
        engine = DistributedEngine.create(
            EngineConfig(model=f"hf:{hf_dirs['llama']}", device="cpu", collective_timeout_s=60)
        )
        try:
            yield engine
        finally:
            engine.shutdown()


def _truncated_copy(src, dst):
    dst.mkdir()
    for path in src.iterdir():
        data = path.read_bytes()
        if path.suffix == ".safetensors":
            data = data[: len(data) - 64]  # the last tensor loses its tail
        (dst / path.name).write_bytes(data)
    return dst


def test_reload_writes_in_place_and_a_damaged_checkpoint_keeps_the_old_weights(
    engine, hf_dirs, tmp_path, monkeypatch
):
    model = engine.loaded.model
    params = {n: p.data_ptr() for n, p in model.named_parameters()}

    def no_build(*args, **kwargs):
        raise AssertionError("LoadWeights built a second model")

    monkeypatch.setattr(served_model, "build_model", no_build)
    version = engine.load_weights(f"hf:{hf_dirs['llama_b']}", "b")
    assert version == "b" and engine.loaded.model is model
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == params
    got = engine_logprobs(engine, token_batch())
    assert np.abs(got - _reference(hf_dirs["llama_b"])).max() <= TOL

    bad = _truncated_copy(hf_dirs["llama"], tmp_path / "truncated")
    with pytest.raises(CheckpointError, match="truncated"):
        engine.load_weights(f"hf:{bad}", "")
    assert engine.info().weights_version == "b"
    got = engine_logprobs(engine, token_batch())
    assert np.abs(got - _reference(hf_dirs["llama_b"])).max() <= TOL


def test_a_read_failing_after_the_agreement_breaks_the_replica(engine, hf_dirs, monkeypatch):
    real = SafetensorsDir._read_span
    reads = []

    def fail_third_read(self, name, first, out):
        reads.append(name)
        if len(reads) == 3:
            raise CheckpointError("disk gone")
        real(self, name, first, out)

    monkeypatch.setattr(SafetensorsDir, "_read_span", fail_third_read)
    with pytest.raises(WorkerLostError, match="after the weights began to be overwritten"):
        engine.load_weights(f"hf:{hf_dirs['llama_b']}", "")
    with pytest.raises(WorkerLostError):
        engine_logprobs(engine, token_batch())


def test_a_push_open_across_a_reload_is_refused_at_its_commit(engine, hf_dirs):
    """The reload keeps the model object, so the engine tells a reload by its LoadedModel."""
    engine.begin_weight_update(WEIGHT_NAMES_MEGATRON)
    engine.load_weights(f"hf:{hf_dirs['llama_b']}", "b")
    with pytest.raises(CheckpointError, match=r"reloaded \(LoadWeights\) during the push"):
        engine.commit_weights("pushed", partial=True)
    assert engine.info().weights_version == "b"
    engine.begin_weight_update(WEIGHT_NAMES_MEGATRON)  # without a reload: commits
    assert engine.commit_weights("pushed", partial=True) == "pushed"

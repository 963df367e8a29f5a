"""Fixtures for the checkpoint tests: tiny HF checkpoints and a one-rank gloo world."""

from __future__ import annotations

from pathlib import Path

import pytest

from megascore.config import EngineConfig
from megascore.model.build import build_model
from testkit.checkpoints import FAMILIES, write_hf_checkpoint


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """family -> HF checkpoint dir (``reference.npy`` inside); ``llama_b`` is a second
    llama with other weights; ``llama_sharded`` is llama saved in several shards."""
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for family in FAMILIES:
        dirs[family] = root / family
        write_hf_checkpoint(family, dirs[family])
    dirs["llama_b"] = root / "llama_b"
    write_hf_checkpoint("llama", dirs["llama_b"], seed=1)
    dirs["llama_sharded"] = root / "llama_sharded"
    write_hf_checkpoint("llama", dirs["llama_sharded"], max_shard_size="40KB")
    return dirs


@pytest.fixture
def build(pgs):
    """build(model_cfg, dtype="float32") -> a one-rank CPU GPTModel."""

    def _build(model_cfg, dtype: str = "float32"):
        return build_model(model_cfg, EngineConfig(device="cpu", dtype=dtype), pgs)

    return _build

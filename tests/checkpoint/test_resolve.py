"""Model strings (the one grammar), metadata and weights versions (no model is built here)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys

import pytest

from megascore.api.errors import CheckpointError
from megascore.checkpoint import (
    ModelSpec,
    check_same_architecture,
    parse_model_string,
    read_model_config,
    resolve_model,
)
from megascore.model.config import builtin_model


def test_parse_model_string_is_the_one_grammar():
    assert parse_model_string("tiny") == ModelSpec("builtin", "tiny")
    assert parse_model_string("tiny@7") == ModelSpec("builtin", "tiny", seed=7)
    assert parse_model_string("builtin:tiny-moe@-3") == ModelSpec("builtin", "tiny-moe", seed=-3)
    assert parse_model_string("hf:/ckpt/llama-3/") == ModelSpec(
        "hf", "llama-3", path="/ckpt/llama-3/"
    )
    assert parse_model_string("megatron:rel/dir") == ModelSpec("megatron", "dir", path="rel/dir")
    for bad, match in (
        ("llama-7b", "use a built-in name"),
        ("builtin:nope@1", "use a built-in name"),
        ("tiny@x", "seed after '@' must be an integer"),
        ("hf:", "missing directory after 'hf:'"),
        ("megatron:", "missing directory after 'megatron:'"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_model_string(bad)
    with pytest.raises(ValueError, match="use a built-in name"):
        resolve_model("llama-7b")  # every entry point speaks the same grammar
    with pytest.raises(ValueError, match="seed after"):
        read_model_config("tiny@x")


def test_builtin_resolves_without_loader():
    cfg, load, meta = resolve_model("tiny", seed=5)
    assert (
        load is None and cfg.seed == 5 and cfg == dataclasses.replace(builtin_model("tiny"), seed=5)
    )
    assert (meta.kind, meta.name, meta.checkpoint_path, meta.weights_version) == (
        "builtin",
        "tiny",
        "",
        "builtin:tiny@5",
    )
    # The seed in the string wins over the default one; without either, the config's.
    assert resolve_model("tiny@7", seed=5).metadata.weights_version == "builtin:tiny@7"
    default = builtin_model("tiny").seed
    assert resolve_model("builtin:tiny").model_config.seed == default


def test_hf_metadata_tokenizer_and_version(hf_dirs, tmp_path):
    directory = tmp_path / "m"
    shutil.copytree(hf_dirs["llama"], directory)
    _, load, meta = resolve_model(f"hf:{directory}")
    assert callable(load)
    assert (meta.kind, meta.name, meta.checkpoint_path) == ("hf", "m", str(directory))
    assert not meta.has_tokenizer and meta.checkpoint_dtype == "float32"
    (directory / "tokenizer.json").write_text("{}")
    again = resolve_model(f"hf:{directory}").metadata
    assert again.has_tokenizer and again.weights_version == meta.weights_version
    weights = directory / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert resolve_model(f"hf:{directory}").metadata.weights_version != meta.weights_version


def test_bad_directories(tmp_path):
    with pytest.raises(CheckpointError, match="is not a directory"):
        resolve_model(f"hf:{tmp_path / 'nope'}")
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve_model(f"hf:{tmp_path}")
    with pytest.raises(CheckpointError, match="megascore.json: missing"):
        resolve_model(f"megatron:{tmp_path}")


def test_check_same_architecture():
    cfg = builtin_model("tiny")
    check_same_architecture(dataclasses.replace(cfg, seed=9, architecture="llama"), cfg)
    with pytest.raises(CheckpointError, match=r"x: architecture differs.*vocab_size: 256 != 512"):
        check_same_architecture(dataclasses.replace(cfg, vocab_size=256), cfg, "x")


def test_read_model_config_reads_the_config_file_only(hf_dirs, tmp_path):
    only = tmp_path / "config-only"  # no weight file: resolve_model would refuse it
    only.mkdir()
    shutil.copy(hf_dirs["llama"] / "config.json", only)
    assert read_model_config(f"hf:{only}") == resolve_model(f"hf:{hf_dirs['llama']}").model_config
    assert read_model_config("tiny") == builtin_model("tiny")
    with pytest.raises(CheckpointError, match="is not a directory"):
        read_model_config(f"megatron:{tmp_path / 'nope'}")
    with pytest.raises(CheckpointError, match="megascore.json: missing"):
        read_model_config(f"megatron:{only}")


def test_package_import_is_torch_free():
    code = "import sys, megascore.checkpoint; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hf_copies_with_equal_mtimes_get_distinct_versions(hf_dirs, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    shutil.copytree(hf_dirs["llama"], first)  # copytree keeps mtimes, like cp -p
    shutil.copytree(hf_dirs["llama"], second)
    v1 = resolve_model(f"hf:{first}").metadata.weights_version
    v2 = resolve_model(f"hf:{second}").metadata.weights_version
    assert v1 != v2

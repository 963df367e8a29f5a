"""Issue 16: every loader writes every parameter once; megatron-bridge only where it applies.

* megascore's HF reader: a plan that misses a parameter fails the load naming it,
  before anything is written.
* megatron-bridge (a fake ``AutoBridge`` patched in: the real one needs CUDA): used only
  for a TransformerEngine-spec model whose architecture it handles; Mixtral (no bridge)
  falls back to megascore's reader and matches transformers; conversion tasks that miss
  or repeat a parameter fail the load before the bridge writes anything.
* Megatron checkpoints: ``_extra_state`` entries keyed as the other backend keys them
  (TransformerEngine's grouped experts, its core-attention FP8 state) neither go missing
  nor matter when loading into the torch backend.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from megatron.core import dist_checkpointing

from megascore.api.errors import CheckpointError
from megascore.checkpoint import hf_bridge, hf_weights
from megascore.checkpoint.checks import check_every_parameter_written
from megascore.checkpoint.megatron_ckpt import CONFIG_FILE, FORMAT, config_to_json
from megascore.checkpoint.resolve import resolve_model
from megascore.checkpoint.safetensors_io import SafetensorsDir
from megascore.model.config import builtin_model
from testkit.checkpoints import megatron_logprobs, token_batch


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "_extra_state" not in k}


def _unchanged(before, model) -> bool:
    after = _params(model)
    return all(torch.equal(before[k], after[k]) for k in before)


def test_check_names_missing_repeated_and_unknown():
    check_every_parameter_written(["a", "b"], ["b", "a"], "ckpt")
    with pytest.raises(CheckpointError, match=r"ckpt: 1 parameters written by no mapping: \['b'\]"):
        check_every_parameter_written(["a", "b"], ["a"], "ckpt")
    with pytest.raises(CheckpointError, match=r"written more than once: \['a'\]"):
        check_every_parameter_written(["a", "b"], ["a", "a", "b"], "ckpt")
    with pytest.raises(CheckpointError, match=r"the model does not have: \['c'\]"):
        check_every_parameter_written(["a"], ["a", "c"], "ckpt")


def test_native_plan_missing_a_parameter_fails_naming_it(hf_dirs, build, monkeypatch):
    real = hf_weights.plan_hf_load
    dropped = "decoder.layers.1.mlp.linear_fc2.weight"

    def plan_without_one(*args, **kwargs):
        plan = real(*args, **kwargs)
        del plan.recipes[dropped]  # a family recipe that forgot a tensor
        return plan

    monkeypatch.setattr(hf_weights, "plan_hf_load", plan_without_one)
    cfg, load, _ = resolve_model(f"hf:{hf_dirs['llama']}")
    model = build(cfg)
    before = _params(model)
    with pytest.raises(CheckpointError, match=rf"written by no mapping: \['{dropped}'\]"):
        load(model)
    assert _unchanged(before, model)


class FakeAutoBridge:
    """megatron-bridge's AutoBridge API as megascore uses it, with Llama as its only bridge.

    ``get_conversion_tasks`` lists one task per model parameter (minus ``drop``, plus
    ``repeat``); ``load_hf_weights`` fills the tasks' parameters with megascore's own
    recipes.
    """

    architectures = ("LlamaForCausalLM",)
    drop: tuple[str, ...] = ()
    repeat: tuple[str, ...] = ()
    loads: list[str] = []

    def __init__(self, directory: str):
        self.directory = directory

    @classmethod
    def can_handle(cls, path: str) -> bool:
        config = json.loads((hf_weights.Path(path) / "config.json").read_text())
        return any(a in cls.architectures for a in config.get("architectures", []))

    @classmethod
    def from_hf_pretrained(cls, path: str) -> FakeAutoBridge:
        return cls(path)

    def get_conversion_tasks(self, models):
        names = [n for n in models[0].state_dict() if "_extra_state" not in n]
        names = [n for n in names if n not in self.drop] + list(self.repeat)
        task = type("Task", (), {})
        tasks = [task() for _ in names] + [None]  # None: a parameter without mapping
        for t, name in zip(tasks, names, strict=False):
            t.param_name, t.param_weight = name, object()
        return tasks

    def load_hf_weights(self, models) -> None:
        FakeAutoBridge.loads.append(self.directory)
        cfg = resolve_model(f"hf:{self.directory}").model_config
        only = {t.param_name for t in self.get_conversion_tasks(models) if t is not None}
        hf_weights.load_hf_weights(models[0], cfg, self.directory, only=only)


@pytest.fixture
def fake_bridge(monkeypatch):
    """Patches the fake in as an importable megatron-bridge; yields its class."""
    monkeypatch.setattr(hf_bridge, "import_auto_bridge", lambda: (FakeAutoBridge, ""))
    monkeypatch.setattr(FakeAutoBridge, "loads", [])
    monkeypatch.delenv(hf_bridge.LOADER_ENV, raising=False)
    return FakeAutoBridge


def _te_model(build, cfg):
    """A CPU model that reports the TransformerEngine spec (what the bridge requires)."""
    model = build(cfg)
    model.megascore_attention_backend = "te"
    return model


def _reference(directory) -> np.ndarray:
    return np.load(directory / "reference.npy")


def test_bridge_loads_an_architecture_it_handles(hf_dirs, build, pgs, fake_bridge):
    cfg, load, _ = resolve_model(f"hf:{hf_dirs['llama']}")
    model = _te_model(build, cfg)
    load(model)
    assert fake_bridge.loads == [str(hf_dirs["llama"])]
    got = megatron_logprobs(model, token_batch(), pgs.tp)
    np.testing.assert_allclose(got, _reference(hf_dirs["llama"]), atol=1e-4)


def test_mixtral_falls_back_to_the_native_loader(hf_dirs, build, pgs, fake_bridge, caplog):
    cfg, load, _ = resolve_model(f"hf:{hf_dirs['mixtral']}")
    model = _te_model(build, cfg)
    with caplog.at_level(logging.INFO, logger=hf_bridge.__name__):
        load(model)
    assert fake_bridge.loads == []
    assert "no bridge for ['MixtralForCausalLM']" in caplog.text
    got = megatron_logprobs(model, token_batch(), pgs.tp)
    np.testing.assert_allclose(got, _reference(hf_dirs["mixtral"]), atol=1e-4)


def test_bridge_required_but_not_applicable_is_an_error(hf_dirs, build, fake_bridge, monkeypatch):
    monkeypatch.setenv(hf_bridge.LOADER_ENV, "bridge")
    cfg, load, _ = resolve_model(f"hf:{hf_dirs['mixtral']}")
    with pytest.raises(CheckpointError, match="MEGASCORE_HF_LOADER=bridge, but megatron-bridge"):
        load(_te_model(build, cfg))
    cfg, load, _ = resolve_model(f"hf:{hf_dirs['llama']}")
    with pytest.raises(CheckpointError, match="attention backend 'torch'"):
        load(build(cfg))


def test_torch_backend_never_imports_the_bridge(hf_dirs, build, pgs, monkeypatch):
    def refuse():
        raise AssertionError("megatron.bridge imported for a torch-backend model")

    monkeypatch.setattr(hf_bridge, "import_auto_bridge", refuse)
    cfg, load, _ = resolve_model(f"hf:{hf_dirs['llama']}")
    model = build(cfg)
    load(model)
    got = megatron_logprobs(model, token_batch(), pgs.tp)
    np.testing.assert_allclose(got, _reference(hf_dirs["llama"]), atol=1e-4)


def test_bridge_not_importable_falls_back(hf_dirs, build, monkeypatch):
    monkeypatch.setattr(hf_bridge, "import_auto_bridge", lambda: (None, "ImportError: no CUDA"))
    cfg, _, _ = resolve_model(f"hf:{hf_dirs['llama']}")
    assert hf_bridge.choose_hf_loader(_te_model(build, cfg), hf_dirs["llama"]) == "native"


@pytest.mark.parametrize(
    ("field", "match"),
    [
        ("drop", "written by no mapping: \\['decoder.final_layernorm.weight'\\]"),
        ("repeat", "written more than once: \\['embedding.word_embeddings.weight'\\]"),
    ],
)
def test_bridge_tasks_must_cover_every_parameter_once(
    hf_dirs, build, fake_bridge, monkeypatch, field, match
):
    name = {"drop": "decoder.final_layernorm.weight", "repeat": "embedding.word_embeddings.weight"}
    monkeypatch.setattr(fake_bridge, field, (name[field],))
    cfg, load, _ = resolve_model(f"hf:{hf_dirs['llama']}")
    model = _te_model(build, cfg)
    before = _params(model)
    with pytest.raises(CheckpointError, match=r"\(megatron-bridge\): .*" + match):
        load(model)
    assert fake_bridge.loads == [] and _unchanged(before, model)


def test_bridge_leaves_a_tied_last_stage_output_layer_to_megascore():
    last = dict(share_embeddings_and_output_weights=True, pre_process=False, post_process=True)
    assert hf_bridge.written_by_megascore(SimpleNamespace(**last)) == {
        "output_layer.weight": "model.embed_tokens.weight"
    }
    for change in (
        dict(share_embeddings_and_output_weights=False),  # lm_head.weight: the bridge's
        dict(pre_process=True),  # PP = 1: no output_layer.weight of its own
        dict(post_process=False),  # a first / middle stage
    ):
        assert hf_bridge.written_by_megascore(SimpleNamespace(**{**last, **change})) == {}


def _tied_last_stage(cfg, pgs):
    """The last pipeline stage of a tied model at PP > 1, as Megatron builds it (no
    embedding, its own ``output_layer.weight``), on one rank."""
    from megascore.config import EngineConfig
    from tests.checkpoint.te_spec import cpu_gpt_model

    assert cfg.share_embeddings_and_output_weights
    return cpu_gpt_model(cfg, EngineConfig(device="cpu"), pgs, pre_process=False)


def test_bridge_tied_last_stage_output_layer_is_the_embedding(
    hf_dirs, build, pgs, fake_bridge, monkeypatch
):
    directory = hf_dirs["qwen2"]  # tie_word_embeddings: no lm_head.weight in the files
    cfg, load, _ = resolve_model(f"hf:{directory}")
    build(cfg)  # the CPU measures and generators, as for any model
    model = _tied_last_stage(cfg, pgs)
    assert "output_layer.weight" in _params(model)
    with SafetensorsDir(directory) as reader:
        assert "lm_head.weight" not in reader
        embedding = reader.read("model.embed_tokens.weight")
    # The bridge has no task for a tied output layer (it drops them from its plan).
    monkeypatch.setattr(fake_bridge, "architectures", ("Qwen2ForCausalLM",))
    monkeypatch.setattr(fake_bridge, "drop", ("output_layer.weight",))
    load(model)
    assert fake_bridge.loads == [str(directory)]
    assert torch.equal(model.output_layer.weight, embedding)


def _as_other_backend(sharded: dict) -> dict:
    """The model's sharded state dict with ``_extra_state`` keyed as TransformerEngine's
    layers key it: grouped experts (no ``local_experts``), plus core-attention FP8 state."""
    out = {}
    for name, value in sharded.items():
        if name.endswith("_extra_state") and ".local_experts." in name:
            value = dataclasses.replace(value, key=value.key.replace("experts.experts", "experts"))
        elif name.endswith("linear_qkv._extra_state"):
            core = dataclasses.replace(value, key=value.key.replace("linear_qkv", "core_attention"))
            out[name.replace("linear_qkv", "core_attention")] = core
        out[name] = value
    return out


def test_extra_state_of_the_other_backend_is_ignored(tmp_path, build, pgs):
    cfg = builtin_model("tiny-moe")
    source = build(cfg)
    directory = tmp_path / "te_ckpt"
    directory.mkdir()
    dist_checkpointing.save(_as_other_backend(source.sharded_state_dict()), str(directory))
    meta = {"format": FORMAT, "model_config": config_to_json(cfg), "dtype": "float32"}
    (directory / CONFIG_FILE).write_text(json.dumps(meta))
    target = build(dataclasses.replace(cfg, seed=cfg.seed + 1))  # other weights
    _, load, _ = resolve_model(f"megatron:{directory}")
    load(target)
    want, got = _params(source), _params(target)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)

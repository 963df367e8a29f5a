"""Checkpoints as trainers save them: optional parts declared one way, stored another.

* DeepSeek-V3 / GLM-4.5 saved by transformers' own ``save_pretrained`` (MTP layers
  declared in config.json, stored by no file) resolve without MTP layers, with a warning
  naming them, and load to logprobs equal to transformers'; ``ignore_mtp_layers`` leaves
  out stored ones too (also for a built-in), a Megatron checkpoint refuses it; of two
  declared MTP layers the leading stored one is kept; a batch asking for MTP metrics of
  such a model is refused naming ``return_mtp_metrics`` and the reason.
* Output layer: a tied model stored as ``lm_head.weight`` only, a tied model stored with
  a different ``lm_head.weight`` beside the embedding (served with the stored head, as
  transformers does), and an untied model without ``lm_head.weight`` (refused naming it).
Every served variant's logprobs are compared with transformers loading the same files.
(Through the server at TP=1 / TP=2 / EP=2: ``tests/e2e/test_family_serving.py``.)
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
import transformers

from megascore.api.errors import CheckpointError, InvalidRequestError
from megascore.api.limits import Limits
from megascore.api.types import ScoreBatch
from megascore.checkpoint import check_same_architecture, read_model_config, resolve_model
from megascore.checkpoint.optional_parts import served_mtp_layers
from megascore.model.config import builtin_model
from testkit.checkpoints import (
    hf_logprobs,
    make_hf_model,
    megatron_logprobs,
    token_batch,
)
from tests.checkpoint.test_hf_convert import _rewrite

TOL = 1e-4


def _served_logprobs(directory, build, pgs, **resolve) -> np.ndarray:
    cfg, load, _ = resolve_model(f"hf:{directory}", **resolve)
    model = build(cfg)
    load(model)
    return megatron_logprobs(model, token_batch(), pgs.tp)


def _transformers_logprobs(directory) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return hf_logprobs(model.eval(), token_batch())


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_mtp_layers_saved_by_transformers_are_left_out(tmp_path, build, pgs, caplog, family):
    directory = tmp_path / family
    make_hf_model(family).save_pretrained(directory)  # keeps num_nextn_predict_layers = 1
    with caplog.at_level(logging.WARNING, "megascore.checkpoint.optional_parts"):
        cfg = resolve_model(f"hf:{directory}").model_config
    assert cfg.mtp_num_layers is None
    assert "num_nextn_predict_layers" in cfg.mtp_not_served
    assert "model.layers.3.*" in cfg.mtp_not_served  # 3 decoder layers, then the MTP layer
    assert cfg.mtp_not_served in caplog.text
    check_same_architecture(read_model_config(f"hf:{directory}"), cfg)  # hot reload agrees

    got = _served_logprobs(directory, build, pgs)
    assert np.abs(got - _transformers_logprobs(directory)).max() <= TOL


def test_ignore_mtp_layers_leaves_out_stored_ones(hf_dirs, build, pgs):
    directory = hf_dirs["deepseek_v3"]  # MTP layer stored
    assert resolve_model(f"hf:{directory}").model_config.mtp_num_layers == 1
    cfg = resolve_model(f"hf:{directory}", ignore_mtp_layers=True).model_config
    assert cfg.mtp_num_layers is None and "ignore_mtp_layers" in cfg.mtp_not_served
    assert read_model_config(f"hf:{directory}", ignore_mtp_layers=True).mtp_num_layers is None
    got = _served_logprobs(directory, build, pgs, ignore_mtp_layers=True)
    assert np.abs(got - np.load(directory / "reference.npy")).max() <= TOL

    tiny_moe = resolve_model("tiny-moe", ignore_mtp_layers=True).model_config
    assert builtin_model("tiny-moe").mtp_num_layers and tiny_moe.mtp_num_layers is None


def test_ignore_mtp_layers_is_refused_for_a_megatron_checkpoint(tmp_path, monkeypatch):
    from megascore.checkpoint import megatron_ckpt

    with_mtp = builtin_model("tiny-moe")
    monkeypatch.setattr(megatron_ckpt, "read_checkpoint_config", lambda d: (with_mtp, {}))
    with pytest.raises(CheckpointError, match="ignore_mtp_layers applies to hf:"):
        read_model_config(f"megatron:{tmp_path}", ignore_mtp_layers=True)
    assert read_model_config(f"megatron:{tmp_path}") is with_mtp


def test_the_leading_stored_mtp_layers_are_kept():
    cfg = dataclasses.replace(builtin_model("tiny-moe"), mtp_num_layers=2)
    first = f"model.layers.{cfg.num_layers}."
    names = ["model.embed_tokens.weight", first + "enorm.weight", first + "eh_proj.weight"]
    kept = served_mtp_layers(cfg, names, ignore=False, source="ckpt")
    assert kept.mtp_num_layers == 1
    assert kept.mtp_not_served.endswith(f"not served: model.layers.{cfg.num_layers + 1}.*")
    stored = names + [f"model.layers.{cfg.num_layers + 1}.enorm.weight"]
    assert served_mtp_layers(cfg, stored, ignore=False, source="ckpt") is cfg


def test_mtp_metrics_of_a_model_without_its_mtp_layers_are_refused():
    """By the engine's check and by the wire gate, naming the option and the reason."""
    from megascore.v1 import scoring_pb2 as pb
    from megascore_server.validation import validate_options

    limits = Limits(
        vocab_size=16,
        max_sequence_length=8,
        max_top_k=4,
        loss_names=("nll",),
        mtp_not_served="why",
    )
    ids, lengths = np.arange(6), np.array([2, 4])
    ScoreBatch(token_ids=ids, lengths=lengths, return_moe_metrics=True).check(limits)
    asked = ScoreBatch(token_ids=ids, lengths=lengths, return_mtp_metrics=True)
    refusal = "options.return_mtp_metrics: the served model has no MTP layers: why"
    with pytest.raises(InvalidRequestError, match=refusal):
        asked.check(limits)
    with pytest.raises(InvalidRequestError, match=refusal):
        validate_options(pb.ScoreOptions(return_mtp_metrics=True), limits)
    asked.check(dataclasses.replace(limits, mtp_not_served=""))


def test_tied_head_stored_as_lm_head_only(hf_dirs, tmp_path, build, pgs):
    directory = tmp_path / "qwen2"  # tie_word_embeddings = true
    _rewrite(
        hf_dirs["qwen2"],
        directory,
        lambda t: {
            ("lm_head.weight" if k == "model.embed_tokens.weight" else k): v for k, v in t.items()
        },
    )
    assert resolve_model(f"hf:{directory}").model_config.share_embeddings_and_output_weights
    got = _served_logprobs(directory, build, pgs)
    ref = np.load(hf_dirs["qwen2"] / "reference.npy")
    assert np.abs(got - ref).max() <= TOL
    assert np.abs(_transformers_logprobs(directory) - ref).max() <= TOL


def test_tied_head_stored_beside_the_embedding_is_served(hf_dirs, tmp_path, build, pgs, caplog):
    directory = tmp_path / "qwen2"
    gen = torch.Generator().manual_seed(3)

    def add_head(t):
        return {
            **t,
            "lm_head.weight": torch.randn(t["model.embed_tokens.weight"].shape, generator=gen),
        }

    _rewrite(hf_dirs["qwen2"], directory, add_head)
    with caplog.at_level(logging.WARNING, "megascore.checkpoint.optional_parts"):
        cfg = resolve_model(f"hf:{directory}").model_config
    assert not cfg.share_embeddings_and_output_weights
    assert "tie_word_embeddings=true" in caplog.text
    got = _served_logprobs(directory, build, pgs)
    ref = _transformers_logprobs(directory)  # transformers unties two different tensors
    assert np.abs(ref - np.load(hf_dirs["qwen2"] / "reference.npy")).max() > 1.0
    assert np.abs(got - ref).max() <= TOL


def test_untied_head_missing_is_refused_naming_it(hf_dirs, tmp_path, build):
    directory = tmp_path / "llama"  # tie_word_embeddings = false
    _rewrite(
        hf_dirs["llama"], directory, lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"}
    )
    cfg, load, _ = resolve_model(f"hf:{directory}")
    model = build(cfg)
    with pytest.raises(CheckpointError, match="'lm_head.weight'.*tie_word_embeddings=false"):
        load(model)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_a_transformers_model_pushes_every_tensor_of_a_model_without_mtp(
    tmp_path, build, pgs, family
):
    """Served without its MTP layers, the model takes exactly what transformers holds: a
    trainer's ``state_dict()`` push is complete (no ``partial=True`` needed)."""
    from megascore.api.types import LAYOUT_COMMON, LAYOUT_FUSED, WEIGHT_NAMES_HF
    from tests.checkpoint.test_weight_staging import _targets

    trainer = make_hf_model(family)
    trainer.save_pretrained(tmp_path)
    cfg, load, _ = resolve_model(f"hf:{tmp_path}")
    served = build(cfg)
    load(served)
    targets = _targets(served, cfg, pgs, WEIGHT_NAMES_HF)
    used = {n for n, t in targets.items() if t.layout in (LAYOUT_COMMON, LAYOUT_FUSED)}
    assert used == set(trainer.state_dict()), used ^ set(trainer.state_dict())

"""HF safetensors -> Megatron GPTModel on one rank: parity with transformers, dtypes,
sharded files, and every way a checkpoint can be broken (model left untouched)."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megascore.api.errors import CheckpointError
from megascore.checkpoint import resolve_model
from megascore.checkpoint.hf_names import ParamMapper
from megascore.checkpoint.hf_weights import load_hf_weights, plan_hf_load
from megascore.checkpoint.recipes import ParallelRanks, Src, VocabRows
from megascore.checkpoint.safetensors_io import SafetensorsDir
from megascore.config import EngineConfig
from megascore.engine.weights.served_model import load_served_model, reload_served_model
from megascore.model.config import builtin_model
from megascore.model.weights import canonical_name
from testkit.checkpoints import FAMILIES, megatron_logprobs, token_batch

TOL = 1e-4


def _reference(directory) -> np.ndarray:
    return np.load(directory / "reference.npy")


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _rewrite(src, dst, edit) -> None:
    """Copies an HF checkpoint, passing its tensors through ``edit(dict) -> dict``."""
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(edit(tensors), str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_match_transformers(hf_dirs, build, pgs, family):
    cfg, load, meta = resolve_model(f"hf:{hf_dirs[family]}")
    assert cfg.architecture == family.split("-")[0] and meta.kind == "hf"
    model = build(cfg)
    load(model)
    got = megatron_logprobs(model, token_batch(), pgs.tp)
    ref = _reference(hf_dirs[family])
    assert ref.std() > 0.5, "reference logprobs too flat to detect conversion errors"
    assert np.abs(got - ref).max() <= TOL


def test_sharded_index_checkpoint(hf_dirs, build, pgs):
    directory = hf_dirs["llama_sharded"]
    assert (directory / "model.safetensors.index.json").is_file()
    assert len(list(directory.glob("*.safetensors"))) > 2
    cfg, load, _ = resolve_model(f"hf:{directory}")
    model = build(cfg)
    load(model)
    got = megatron_logprobs(model, token_batch(), pgs.tp)
    assert np.abs(got - _reference(directory)).max() <= TOL


def test_bf16_checkpoint_into_fp32_and_bf16_models(hf_dirs, tmp_path, build, pgs):
    src = hf_dirs["llama"]
    _rewrite(src, tmp_path / "bf16", lambda t: {k: v.bfloat16() for k, v in t.items()})
    cfg, load, _ = resolve_model(f"hf:{tmp_path / 'bf16'}")
    fp32 = build(cfg)
    load(fp32)
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    assert embed.dtype == torch.bfloat16
    assert torch.equal(fp32.embedding.word_embeddings.weight, embed.float())
    bf16 = build(cfg, dtype="bfloat16")
    load(bf16)
    assert bf16.embedding.word_embeddings.weight.dtype == torch.bfloat16
    assert torch.equal(bf16.embedding.word_embeddings.weight, embed)
    # bf16 weights in an fp32 model still track the fp32 reference closely
    got = megatron_logprobs(fp32, token_batch(), pgs.tp)
    assert np.abs(got - _reference(src)).max() < 0.1


def _corrupt_cases():
    def drop(t):
        del t["model.layers.1.self_attn.k_proj.weight"]
        return t

    def reshape(t):
        w = t["model.layers.0.mlp.down_proj.weight"]
        t["model.layers.0.mlp.down_proj.weight"] = w[:, :64].contiguous()
        return t

    def vocab(t):
        t["model.embed_tokens.weight"] = torch.cat([t["model.embed_tokens.weight"]] * 2)
        return t

    return {  # the message: the file, then the tensor (regex special characters escaped)
        "missing": (drop, "missing tensor 'model.layers.1.self_attn.k_proj.weight'"),
        "wrong_shape": (
            reshape,
            "model.safetensors: tensor 'model.layers.0.mlp.down_proj.weight' has shape "
            "[64, 64], expected [64, 128] from the architecture in config.json",
        ),
        "vocab": (vocab, "model.safetensors: vocab mismatch: tensor 'model.embed_tokens.weight'"),
    }


@pytest.mark.parametrize("case", sorted(_corrupt_cases()))
def test_corrupt_checkpoint_raises_and_leaves_model(hf_dirs, tmp_path, build, case):
    edit, needle = _corrupt_cases()[case]
    _rewrite(hf_dirs["llama"], tmp_path / case, edit)
    cfg, load, _ = resolve_model(f"hf:{hf_dirs['llama']}")
    model = build(cfg)
    before = _params(model)
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        load_hf_weights(model, cfg, tmp_path / case)
    after = _params(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_truncated_file_names_file_and_tensor(hf_dirs, tmp_path):
    directory = tmp_path / "trunc"
    shutil.copytree(hf_dirs["llama"], directory)
    path = directory / "model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated: tensor '"):
        resolve_model(f"hf:{directory}")
    with open(path, "r+b") as f:
        f.truncate(5)
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        resolve_model(f"hf:{directory}")


def test_reader_slices_equal_torch_indexing_directly_or_converted(tmp_path):
    """``read`` of any basic index equals torch's; ``read_into`` fills a parameter straight
    from the file where the slice is one span of it, else converts, with the same values."""
    gen = torch.Generator().manual_seed(0)
    stored = {
        "w": torch.randn(3, 6, 5, generator=gen),
        "b": torch.randn(7, 4, generator=gen).to(torch.bfloat16),
    }
    save_file(stored, str(tmp_path / "model.safetensors"))
    cases = {
        "w": [(), (1,), (slice(1, 3),), (0, slice(2, 5)), (slice(None), slice(None), slice(1, 3))],
        "b": [(slice(2, 6),), (slice(None), slice(1, 3)), (slice(3, 3),)],
    }
    direct = []  # the tensors the file's bytes went into
    with SafetensorsDir(tmp_path) as reader:
        real = reader._read_span

        def spy(name, first, out):
            direct.append(out.data_ptr())
            real(name, first, out)

        reader._read_span = spy
        for name, indices in cases.items():
            for index in indices:
                want = stored[name][index]  # a view: contiguous iff one span of the file
                assert torch.equal(reader.read(name, index), want), (name, index)
                for dtype in (want.dtype, torch.float32):
                    out = torch.full(want.shape, float("nan"), dtype=dtype)
                    direct.clear()
                    reader.read_into(name, out, index)
                    assert torch.equal(out, want.to(dtype)), (name, index, dtype)
                    straight = dtype == want.dtype and want.is_contiguous()
                    if want.numel():  # an empty tensor has no address to tell
                        assert (out.data_ptr() in direct) == straight, (name, index, dtype)


def test_missing_shard_and_no_weights(hf_dirs, tmp_path):
    directory = tmp_path / "sharded"
    shutil.copytree(hf_dirs["llama_sharded"], directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (directory / victim).unlink()
    with pytest.raises(CheckpointError, match=f"{victim}: shard named by"):
        resolve_model(f"hf:{directory}")
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(hf_dirs["llama"] / "config.json", empty)
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        resolve_model(f"hf:{empty}")


def test_reload_writes_the_served_parameters_in_place_and_refuses_bad_checkpoints(
    hf_dirs, tmp_path, pgs
):
    """The engine's load paths on HF checkpoints: start-up, then reloads into the served
    parameters themselves (no second model); a checkpoint that does not fit is refused
    before anything is written."""
    engine_cfg = EngineConfig(device="cpu")
    served = load_served_model(f"hf:{hf_dirs['llama']}", engine_cfg, pgs)
    storage = {n: t.data_ptr() for n, t in served.model.named_parameters()}

    _rewrite(
        hf_dirs["llama"],
        tmp_path / "bad",
        lambda t: {k: v for k, v in t.items() if "layers.1.mlp" not in k},
    )
    with pytest.raises(CheckpointError, match="model.layers.1.mlp"):
        reload_served_model(served, f"hf:{tmp_path / 'bad'}", engine_cfg, pgs)
    with pytest.raises(CheckpointError, match="architecture differs"):
        reload_served_model(served, f"hf:{hf_dirs['qwen2']}", engine_cfg, pgs)
    got = megatron_logprobs(served.model, token_batch(), pgs.tp)
    assert np.abs(got - _reference(hf_dirs["llama"])).max() <= TOL

    new = reload_served_model(served, f"hf:{hf_dirs['llama_b']}", engine_cfg, pgs)
    assert new.model is served.model and new.spec.path == str(hf_dirs["llama_b"])
    assert {n: t.data_ptr() for n, t in new.model.named_parameters()} == storage
    got = megatron_logprobs(new.model, token_batch(), pgs.tp)
    assert np.abs(got - _reference(hf_dirs["llama_b"])).max() <= TOL


def _te_name(name: str, is_moe: bool) -> str:
    """The TransformerEngine-spec name of a local-spec parameter."""
    name = name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
    if not is_moe:  # TE fuses the pre-MLP norm into linear_fc1 of a dense MLP only
        name = name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
    return re.sub(
        r"experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight", r"experts.\2.weight\1", name
    )


@pytest.mark.parametrize("family", ["llama", "mixtral", "qwen3_moe"])
def test_te_parameter_names_map_like_local_ones(hf_dirs, build, family):
    cfg, _, _ = resolve_model(f"hf:{hf_dirs[family]}")
    model = build(cfg)
    with SafetensorsDir(hf_dirs[family]) as reader:
        local = plan_hf_load(model, cfg, reader).recipes
        mapper = ParamMapper(cfg, reader, ParallelRanks())
        for name, recipe in local.items():
            te = mapper(_te_name(name, cfg.is_moe), 0)
            te.fit(recipe.target_shape)
            assert te.sources() == recipe.sources(), name
            assert type(te) is type(recipe) and te.local_shape() == recipe.local_shape()


def test_te_grouped_expert_names_are_canonical(build):
    """TE's grouped experts (``experts.linear_fc1.weight{i}``, the TE backend's
    moe_grouped_gemm) have the canonical names of the local spec's ``local_experts.{i}``:
    built-in weights, weight pushes and the every-parameter checks see the same tensors."""
    cfg = builtin_model("tiny-moe")
    names = [n for n, _ in build(cfg).named_parameters()]
    experts = [n for n in names if ".local_experts." in n]
    assert experts
    for name in names:
        kw = dict(ep_rank=1, num_local_experts=cfg.num_moe_experts)
        assert canonical_name(_te_name(name, True), **kw) == canonical_name(name, **kw), name
    assert canonical_name("decoder.layers.2.mlp.experts.linear_fc2.weight3", ep_rank=1,
                          num_local_experts=4) == (
        "decoder.layers.2.mlp.experts.local_experts.7.linear_fc2.weight"
    )  # fmt: skip


def test_vocab_padding_rows_are_zero(hf_dirs):
    src = Src("model.embed_tokens.weight", (256, 64))
    with SafetensorsDir(hf_dirs["llama"]) as reader:
        full = reader.read(src.name)
        parts = []
        for rank in range(2):  # 2 TP ranks of a model padded to 260 rows
            recipe = VocabRows(src, rank, 2)
            recipe.fit((130, 64))
            recipe.validate(reader, "embedding.word_embeddings.weight")
            parts.append(recipe.read(reader))
        recipe = VocabRows(src, 0, 2)
        recipe.fit((100, 64))
        with pytest.raises(CheckpointError, match="vocab mismatch"):
            recipe.validate(reader, "embedding.word_embeddings.weight")
    padded = torch.cat(parts)
    assert torch.equal(padded[:256], full) and not padded[256:].any()


def _to_stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Mixtral hub layout -> transformers 5's stacked one (gate_up_proj [E, 2F, H])."""
    out = {}
    for i in range(2):
        p = f"model.layers.{i}.block_sparse_moe."
        experts = range(4)
        out[f"model.layers.{i}.mlp.gate.weight"] = tensors.pop(p + "gate.weight")
        w = {
            k: [tensors.pop(f"{p}experts.{e}.{k}.weight") for e in experts]
            for k in ("w1", "w2", "w3")
        }
        gate_up = [torch.cat([g, u]) for g, u in zip(w["w1"], w["w3"], strict=True)]
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(w["w2"])
    return {**tensors, **out}


def test_transformers5_stacked_experts(hf_dirs, tmp_path, build, pgs):
    _rewrite(hf_dirs["mixtral"], tmp_path / "stacked", _to_stacked_experts)
    cfg, load, _ = resolve_model(f"hf:{tmp_path / 'stacked'}")
    model = build(cfg)
    load(model)
    got = megatron_logprobs(model, token_batch(), pgs.tp)
    assert np.abs(got - _reference(hf_dirs["mixtral"])).max() <= TOL

"""LoRA adapters from what peft saves (issue 46 item 2): parity with transformers + peft,
a step mixing adapters and the base, pushes, refusals.

Each adapter is a real peft ``LoraConfig`` over the family's tiny checkpoint of
``hf_dirs`` (``testkit.checkpoints``), its LoRA tensors drawn at random (peft's zero
``lora_B`` would change nothing), saved with ``save_pretrained`` and loaded into the
Megatron model with ``megascore.checkpoint.lora_weights``. TP=2 / PP=2: ``test_lora_parallel.py``.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from megascore.api.errors import CheckpointError
from megascore.checkpoint import resolve_model
from megascore.checkpoint.lora_weights import load_adapter, push_adapter, remove_adapter
from megascore.config import EngineConfig
from megascore.model.batch_invariant import make_batch_invariant
from megascore.model.build import build_model
from megascore.model.lora import attach
from testkit.checkpoints import VOCAB, token_batch
from tests.checkpoint.lora_cases import (
    ALL,
    ATTENTION,
    logprobs,
    packed_logits,
    peft_model,
    write_adapter,
)

TOL = 1e-4  # vs transformers + peft, float32
PARITY = {  # case -> (family, LoraConfig fields)
    "llama-r8": ("llama", dict(r=8, lora_alpha=16, target_modules=ALL)),
    "llama-r16-rslora": ("llama", dict(r=16, lora_alpha=8, use_rslora=True, target_modules=ALL)),
    "llama-patterns": (
        "llama",
        dict(
            r=8,
            lora_alpha=16,
            target_modules=".*layers\\.1\\..*(q_proj|v_proj|down_proj)",
            rank_pattern={"down_proj": 4},
            alpha_pattern={"q_proj": 4},
        ),
    ),
    # parts of the fused layers: q and v of linear_qkv, up of linear_fc1
    "llama-qv-up": (
        "llama",
        dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "up_proj"]),
    ),
    "qwen3-r8": ("qwen3", dict(r=8, lora_alpha=16, target_modules=ALL)),
    "qwen3-r16-rslora": ("qwen3", dict(r=16, lora_alpha=8, use_rslora=True, target_modules=ALL)),
    "qwen3_moe-r8": ("qwen3_moe", dict(r=8, lora_alpha=16, target_modules=ATTENTION)),
    "qwen3_moe-r16-rslora": (
        "qwen3_moe",
        dict(r=16, lora_alpha=8, use_rslora=True, target_modules=ATTENTION),
    ),
    # q and v only: linear_qkv's k rows keep the base output
    "qwen3_moe-qv": ("qwen3_moe", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
    "qwen3_moe-ko": ("qwen3_moe", dict(r=2, lora_alpha=2, target_modules=["k_proj", "o_proj"])),
}


@pytest.fixture(scope="module")
def models(hf_dirs, pgs):
    """family -> (ModelConfig, batch-invariant Megatron model), built once."""
    built = {}

    def get(family):
        if family not in built:
            cfg, load, _ = resolve_model(f"hf:{hf_dirs[family]}")
            model = build_model(cfg, EngineConfig(device="cpu"), pgs, random_weights=False)
            make_batch_invariant(model)  # as the engine serves it on the CPU
            load(model)
            built[family] = cfg, model
        return built[family]

    return get


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """case -> (dir, peft logprobs of token_batch(), base logprobs), written once."""
    root, made = tmp_path_factory.mktemp("lora"), {}

    def get(case):
        if case not in made:
            family, lora = PARITY[case]
            made[case] = (root / case, *write_adapter(family, root / case, token_batch(), **lora))
        return made[case]

    return get


@pytest.mark.parametrize("case", list(PARITY))
def test_adapter_matches_transformers_peft(case, models, adapters, pgs):
    family, _ = PARITY[case]
    cfg, model = models(family)
    directory, ref, base_ref = adapters(case)
    slot = load_adapter(model, cfg, case, directory)
    seqs = list(token_batch())
    try:
        got = logprobs(packed_logits(model, pgs, seqs, [slot] * len(seqs)), seqs)
        base = logprobs(packed_logits(model, pgs, seqs, [-1] * len(seqs)), seqs)
    finally:
        remove_adapter(model, case)
    assert np.abs(base_ref - ref).max() > 0.1, "the adapter must change the logprobs"
    assert np.abs(got - ref).max() <= TOL
    assert np.abs(base - base_ref).max() <= TOL


MIXED = {  # family -> four parity cases of that family
    "llama": ["llama-r8", "llama-r16-rslora", "llama-patterns", "llama-qv-up"],
    "qwen3_moe": ["qwen3_moe-r8", "qwen3_moe-r16-rslora", "qwen3_moe-qv", "qwen3_moe-ko"],
}


@pytest.mark.parametrize("family", list(MIXED))
def test_a_step_mixing_four_adapters_and_the_base_equals_each_alone(family, models, adapters, pgs):
    """Seven sequences of other lengths under four adapters and the base in one packed
    forward: each sequence alone with its adapter gives the same bits, and only the base
    sequence the bits of the base model."""
    cfg, model = models(family)
    slots = []
    for i, case in enumerate(MIXED[family]):
        slots.append(load_adapter(model, cfg, f"mix{i}", adapters(case)[0]))
    assert len(set(slots)) == 4
    gen = torch.Generator().manual_seed(7)
    lengths = [9, 20, 2, 31, 14, 1, 6]  # 1 and 2 rows alone: BLAS's small-row paths
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    per_seq = [slots[0], -1, slots[1], slots[2], slots[3], slots[1], slots[0]]
    try:
        mixed = packed_logits(model, pgs, seqs, per_seq)
        for b, (seq, slot) in enumerate(zip(seqs, per_seq, strict=True)):
            alone = packed_logits(model, pgs, [seq], [slot])[0]
            assert torch.equal(mixed[b], alone), f"sequence {b} (slot {slot})"
            base = packed_logits(model, pgs, [seq], [-1])[0]
            assert torch.equal(mixed[b], base) == (slot == -1), f"sequence {b} vs the base"
    finally:
        for i in range(4):
            remove_adapter(model, f"mix{i}")


def test_a_push_replaces_the_tensors_and_a_bad_push_changes_nothing(models, adapters, pgs):
    from peft import get_peft_model_state_dict

    cfg, model = models("llama")
    first = load_adapter(model, cfg, "policy", adapters("llama-r8")[0])
    other = load_adapter(model, cfg, "other", adapters("llama-r16-rslora")[0])
    seqs = list(token_batch())
    try:
        want = packed_logits(model, pgs, seqs, [other] * 3)
        pushed = get_peft_model_state_dict(peft_model("llama", 0, **PARITY["llama-r16-rslora"][1]))
        config = json.loads((adapters("llama-r16-rslora")[0] / "adapter_config.json").read_text())
        assert push_adapter(model, cfg, "policy", pushed, config) == first
        got = packed_logits(model, pgs, seqs, [first] * 3)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        bad = dict(pushed)
        name = next(n for n in bad if n.endswith("q_proj.lora_B.weight"))
        bad[name] = bad[name][:-1]
        with pytest.raises(CheckpointError, match=f"pushed adapter tensors: tensor '{name}'"):
            push_adapter(model, cfg, "policy", bad)  # config kept from the last push
        again = packed_logits(model, pgs, seqs, [first] * 3)
        assert all(torch.equal(g, w) for g, w in zip(again, want, strict=True))
        with pytest.raises(CheckpointError, match="'new' is new and no config"):
            push_adapter(model, cfg, "new", pushed)
    finally:
        remove_adapter(model, "policy")
        remove_adapter(model, "other")
    assert attach(model).names == {}


def test_unknown_slots_and_wrong_row_counts_are_refused(models, adapters, pgs):
    from tests.packed_forward import forward_packed, pack_for_rank

    cfg, model = models("llama")
    with pytest.raises(ValueError, match=r"slots \[3\]"):
        attach(model).set_rows(torch.tensor([-1, 3]))
    slot = load_adapter(model, cfg, "rows", adapters("llama-r8")[0])
    seqs = list(token_batch())
    packed = pack_for_rank(torch.cat(seqs), [len(s) for s in seqs], pgs)
    try:
        with pytest.raises(ValueError, match="the index has 5 rows, decoder layer 0's linear_qkv"):
            with attach(model).rows(torch.full((5,), slot)):
                forward_packed(model, packed)
    finally:
        remove_adapter(model, "rows")


def _peft_dir(root, family, **lora):
    """A real peft save of ``lora`` over the family's model (random LoRA tensors)."""
    directory = root / "peft"
    peft_model(family, 0, **lora).save_pretrained(directory)
    return directory


def _edited_dir(root, good, config=None, add=None, drop=None, change=None):
    """A copy of adapter dir ``good`` with config fields set, tensors added, dropped or
    changed (name -> function of the tensor)."""
    directory = root / "edited"
    shutil.copytree(good, directory)
    data = json.loads((good / "adapter_config.json").read_text())
    (directory / "adapter_config.json").write_text(json.dumps({**data, **(config or {})}))
    tensors = load_file(str(good / "adapter_model.safetensors"))
    tensors.update(add or {})
    for name in drop or ():
        del tensors[name]
    for name, fn in (change or {}).items():
        tensors[name] = fn(tensors[name]).contiguous()
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


P = "base_model.model.model.layers."
Q_B = P + "0.self_attn.q_proj.lora_B.weight"
REFUSALS = {  # case -> (family, how the dir is made, the message names)
    "dora": ("llama", dict(peft=dict(r=4, target_modules=["q_proj"], use_dora=True)), "use_dora"),
    "bias": ("llama", dict(peft=dict(r=4, target_modules=["q_proj"], bias="lora_only")), "bias"),
    "modules_to_save": (
        "llama",
        dict(peft=dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])),
        "modules_to_save",
    ),
    "embeddings-listed": (
        "llama",
        dict(peft=dict(r=4, target_modules=["q_proj", "embed_tokens"])),
        r"target_modules \['embed_tokens'\]",
    ),
    "lm_head-by-regex": (
        "llama",
        dict(peft=dict(r=4, target_modules=".*(q_proj|lm_head)")),
        r"tensor 'base_model\.model\.lm_head\..*': adapters on the output layer",
    ),
    "moe-experts": (
        "qwen3_moe",
        dict(peft=dict(r=4, target_modules=ALL)),
        r"tensor 'base_model\.model\.model\.layers\.1\.mlp\.experts\..*MoE experts",
    ),
    "moe-router": (
        "qwen3_moe",
        dict(peft=dict(r=4, target_modules=".*mlp\\.gate")),
        r"layers\.1\.mlp\.gate\.lora_A\.weight'.*router",
    ),
    "shape": ("llama", dict(change={Q_B: lambda t: t[:-2]}), f"tensor '{Q_B}' has shape"),
    "rank": (
        "llama",
        dict(config={"r": 4}),
        r"expected \[4, \d+\] \(rank 4 from the adapter config",
    ),
    "a-without-b": ("llama", dict(drop=[Q_B]), r"q_proj\.lora_A\.weight' has no lora_B"),
    "mlp-on-a-moe-layer": (  # the llama adapter on qwen3_moe: layer 0 dense, 1 MoE
        "qwen3_moe",
        dict(),
        r"layers\.1\.mlp\.\w+_proj\.lora_[AB]\.weight': layer 1's MLP is a MoE layer",
    ),
    "past-the-layers": (
        "llama",
        dict(add={P + "7.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64)}),
        "layer 7 is past the model's 2 decoder layers",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_unsupported_adapters_are_refused_by_name(case, models, adapters, tmp_path):
    family, how, names = REFUSALS[case]
    cfg, model = models(family)
    if "peft" in how:
        directory = _peft_dir(tmp_path, family, **how["peft"])
    else:
        directory = _edited_dir(tmp_path, adapters("llama-r8")[0], **how)
    with pytest.raises(CheckpointError, match=names) as refused:
        load_adapter(model, cfg, case, directory)
    if "peft" not in how or case.startswith("moe") or case == "lm_head-by-regex":
        assert "adapter_" in str(refused.value)  # the file is named
    assert case not in attach(model).names


def test_missing_files_are_named(models, adapters, tmp_path):
    cfg, model = models("llama")
    good = adapters("llama-r8")[0]
    for missing in ("adapter_model.safetensors", "adapter_config.json"):
        directory = tmp_path / missing
        shutil.copytree(good, directory)
        (directory / missing).unlink()
        with pytest.raises(CheckpointError, match=f"{directory / missing}: missing"):
            load_adapter(model, cfg, "missing", directory)
    with pytest.raises(CheckpointError, match="no such adapter directory"):
        load_adapter(model, cfg, "missing", tmp_path / "nowhere")

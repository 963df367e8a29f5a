"""Weight-push staging on one rank (``megascore.engine.weights.push.apply``) for every family.

The push targets are exactly what ``transformers`` itself has: the names and shapes of
``model.state_dict()`` of each supported family (llama, qwen2 with QKV bias and tied
embeddings, mistral with its own head_dim, mixtral with transformers' fused experts),
the tied ``lm_head.weight`` marked ignored; for Megatron names, the state dict of the
one-rank local-spec model. Pushing another checkpoint's tensors (in the order
transformers lists them) and committing gives every parameter bit for bit the value the
HF loader gives from that checkpoint's files; pushing a one-rank model's own Megatron
state does the same. Mixtral's per-expert names (transformers 4) stage the same shards
as the fused ones. A push that leaves a fused partner out (q without k, v) or misses
tensors says so at the commit and changes nothing.
"""

from __future__ import annotations

import pytest
import torch

from megascore.api.types import (
    LAYOUT_COMMON,
    LAYOUT_FUSED,
    LAYOUT_PER_EXPERT,
    WEIGHT_NAMES_HF,
    WEIGHT_NAMES_MEGATRON,
)
from megascore.checkpoint import resolve_model
from megascore.engine.weights.push.apply import WeightStaging, gather_targets, weight_targets
from testkit.checkpoints import FAMILIES, MTP_FAMILIES, make_hf_model


def _loaded(build, directory):
    config, load, _ = resolve_model(f"hf:{directory}")
    model = build(config)
    load(model)
    return model, config


def _targets(model, config, pgs, names):
    """Every rank's push targets (one rank here), as rank 0 checks a push against them."""
    local = weight_targets(model, config, pgs, names)
    return gather_targets(local, torch.distributed.group.WORLD, config, names)


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in MTP_FAMILIES])
def test_hf_push_equals_loading_the_same_weights(family, build, pgs, hf_dirs, tmp_path):
    served, config = _loaded(build, hf_dirs[family])
    trainer = make_hf_model(family, seed=3)
    state = trainer.state_dict()
    targets = _targets(served, config, pgs, WEIGHT_NAMES_HF)
    used = {n: t for n, t in targets.items() if t.layout in (LAYOUT_COMMON, LAYOUT_FUSED)}
    assert set(used) == set(state), set(used) ^ set(state)
    assert all(used[n].shape == tuple(t.shape) for n, t in state.items())
    tied = config.share_embeddings_and_output_weights
    assert [n for n, t in targets.items() if t.ignored] == (["lm_head.weight"] if tied else [])

    layout = {n: t.layout for n, t in targets.items()}
    staging = WeightStaging(served, config, pgs, WEIGHT_NAMES_HF)
    for name, tensor in state.items():
        if not targets[name].ignored:
            staging.add(name, tensor, layout[name])
    assert staging.problem(partial=False) is None
    assert len(staging.apply()) == len(_params(served))  # each replaced value is a buffer

    trainer.save_pretrained(tmp_path)
    expected, _ = _loaded(build, tmp_path)
    got, want = _params(served), _params(expected)
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_megatron_push_and_refused_pushes(build, pgs, hf_dirs):
    served, config = _loaded(build, hf_dirs["mixtral"])
    before = _params(served)
    source, _ = _loaded(build, hf_dirs["mixtral"])
    with torch.no_grad():
        for p in source.parameters():
            p.mul_(1.5)
    state = _params(source)
    targets = _targets(served, config, pgs, WEIGHT_NAMES_MEGATRON)
    assert {n: t.shape for n, t in targets.items()} == {n: tuple(t.shape) for n, t in state.items()}

    staging = WeightStaging(served, config, pgs, WEIGHT_NAMES_MEGATRON)
    names = list(state)
    for name in names[:3]:
        staging.add(name, state[name], LAYOUT_COMMON)
    assert "parameters not sent" in staging.problem(partial=False)
    assert staging.problem(partial=True) is None
    for name in names[3:]:
        staging.add(name, state[name], LAYOUT_COMMON)
    assert staging.problem(partial=False) is None
    assert all(torch.equal(before[n], p) for n, p in _params(served).items())  # not yet
    staging.apply()
    assert all(torch.equal(state[n], p) for n, p in _params(served).items())

    hf = WeightStaging(served, config, pgs, WEIGHT_NAMES_HF)
    q = "model.layers.0.self_attn.q_proj.weight"
    hf.add(q, make_hf_model("mixtral", 4).state_dict()[q], LAYOUT_COMMON)
    problem = hf.problem(partial=True)
    assert q in problem and "k_proj" in problem and "v_proj" in problem, problem


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers >= 5 Mixtral tensors renamed to the per-expert layout of transformers 4
    (``block_sparse_moe.experts.E.w1/w3/w2``, ``block_sparse_moe.gate``)."""
    out = {}
    for name, t in state.items():
        prefix, _, leaf = name.partition(".mlp.")
        if leaf == "gate.weight":
            out[f"{prefix}.block_sparse_moe.gate.weight"] = t
        elif leaf == "experts.gate_up_proj":  # [E, 2F, H] = [gate; up] per expert
            f = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.block_sparse_moe.experts.{e}.w1.weight"] = t[e, :f]
                out[f"{prefix}.block_sparse_moe.experts.{e}.w3.weight"] = t[e, f:]
        elif leaf == "experts.down_proj":  # [E, H, F]
            for e in range(t.shape[0]):
                out[f"{prefix}.block_sparse_moe.experts.{e}.w2.weight"] = t[e]
        else:
            out[name] = t
    return out


def test_mixtral_per_expert_names_stage_like_fused_ones(build, pgs, hf_dirs):
    served, config = _loaded(build, hf_dirs["mixtral"])
    fused = make_hf_model("mixtral", seed=6).state_dict()
    targets = _targets(served, config, pgs, WEIGHT_NAMES_HF)
    per_expert = _per_expert(fused)
    used = {n for n, t in targets.items() if t.layout in (LAYOUT_COMMON, LAYOUT_PER_EXPERT)}
    assert used == set(per_expert)
    results = []
    for state in (fused, per_expert):
        staging = WeightStaging(served, config, pgs, WEIGHT_NAMES_HF)
        for name, tensor in state.items():
            staging.add(name, tensor, targets[name].layout)
        assert staging.problem(partial=False) is None
        results.append(staging.staged)
    assert set(results[0]) == set(results[1]) == set(_params(served))
    assert all(torch.equal(results[0][n], results[1][n]) for n in results[0])


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_mtp_layers_are_pushed_or_the_push_is_partial(family, build, pgs, hf_dirs):
    """transformers has no MTP layers: its tensors are every target but the MTP layers'
    (HF layers num_layers and up); a full push without them is refused naming the MTP
    parameters, a partial one keeps them."""
    served, config = _loaded(build, hf_dirs[family])
    before = _params(served)
    state = make_hf_model(family, seed=3).state_dict()
    targets = _targets(served, config, pgs, WEIGHT_NAMES_HF)
    mtp = tuple(f"model.layers.{config.num_layers + i}." for i in range(config.mtp_num_layers))
    used = {n for n, t in targets.items() if t.layout in (LAYOUT_COMMON, LAYOUT_FUSED)}
    assert used - set(state) == {n for n in used if n.startswith(mtp)} != set()
    assert set(state) <= used
    staging = WeightStaging(served, config, pgs, WEIGHT_NAMES_HF)
    for name, tensor in state.items():
        if not targets[name].ignored:
            staging.add(name, tensor, targets[name].layout)
    assert "mtp.layers.0." in staging.problem(partial=False)
    assert staging.problem(partial=True) is None
    staging.apply()
    after = _params(served)
    assert all(torch.equal(after[n], before[n]) for n in after if n.startswith("mtp."))
    assert not torch.equal(
        after["decoder.final_layernorm.weight"], before["decoder.final_layernorm.weight"]
    )


def test_device_parameters_keep_no_staging_copy_after_the_commit(build, pgs, hf_dirs):
    """Issue 45: a GPU replica's staged shards (pinned host memory on CUDA) are copied in
    and freed at the commit, not kept as a host copy of the shard for the next push; the
    device parameters are ``meta`` tensors here (a copy into them is a no-op)."""
    import gc
    import weakref

    served, config = _loaded(build, hf_dirs["llama"])
    state = _params(served)
    staging = WeightStaging(served, config, pgs, WEIGHT_NAMES_MEGATRON)
    staging.params = {
        name: torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
        for name, p in staging.params.items()
    }
    for name, tensor in state.items():
        staging.add(name, tensor, LAYOUT_COMMON)
    assert staging.problem(partial=False) is None
    staged = [weakref.ref(t) for t in staging.staged.values()]
    assert len(staged) == len(staging.params) and all(not r().is_pinned() for r in staged)
    assert staging.apply() == {}  # nothing kept for the next push
    gc.collect()
    assert all(ref() is None for ref in staged)  # the staging memory is freed

"""MTP metrics from the checkpoint's MTP layers vs a plain-PyTorch reference.

For the deepseek_v3 (with and without the query LoRA) and glm4_moe tiny checkpoints
(``testkit.checkpoints``: random MTP layers stored as DeepSeek-V3
stores them, after the last decoder layer) the engine serves ``mtp_1_loss`` and
``mtp_1_acceptance_rate``; the reference below computes them from the DeepSeek-V3
paper's definition of the MTP module (section 2.2), reading the MTP tensors straight
from the safetensors (transformers builds no MTP layers):

    h'_i = M [RMSNorm_e(Emb(t_{i+1})); RMSNorm_h(h_i)]     (M = eh_proj, [H, 2H])
    h''  = TRM(h'_{1..})                                     (causal, positions of i)
    P_{i+2} = softmax(OutHead(RMSNorm_f(h''_i)))            (shared_head.norm / .head)

``h`` is the main model's final hidden state (after its final norm, as Megatron hands
it to the MTP block); the concatenation order [embedding; hidden] is the one the
released DeepSeek-V3 / GLM-4.5 weights use (vLLM's and Megatron's MTP layers). TRM is
the transformers decoder-layer class of the family (an independent implementation of
the inner layer, its MoE router included) loaded with the MTP layer's tensors. The loss
is the mean cross-entropy over every position whose target ``t_{i+2}`` exists; the
acceptance rate is the percentage of those positions whose argmax is the target.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open

from megascore.api.types import ScoreBatch
from testkit.checkpoints import MTP_FAMILIES, VOCAB
from testkit.reference import engine_outputs
from tests.one_rank import one_rank_parallel

TOL = 1e-5
LENGTHS = (1, 2, 3, 9, 20, 33)


def _sequences() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, VOCAB, n) for n in LENGTHS]


def _mtp_tensors(directory, layer: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{layer}."
    out = {}
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            out.update(
                {k[len(prefix) :]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
            )
    return out


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _decoder_layer(model, tensors: dict[str, torch.Tensor], index: int):
    """The family's transformers decoder layer holding the MTP layer's tensors (per-expert
    checkpoint tensors stacked into transformers' in-memory layout)."""
    layer = type(model.model.layers[-1])(model.config, index).eval()
    state = {}
    experts = model.config.n_routed_experts
    for name in layer.state_dict():
        if name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            state[name] = torch.stack(
                [
                    torch.cat(
                        [
                            tensors[f"{base}{e}.gate_proj.weight"],
                            tensors[f"{base}{e}.up_proj.weight"],
                        ]
                    )
                    for e in range(experts)
                ]
            )
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            state[name] = torch.stack(
                [tensors[f"{base}{e}.down_proj.weight"] for e in range(experts)]
            )
        else:
            state[name] = tensors[name]
    layer.load_state_dict(state)
    return layer


class MTPReference:
    """The first MTP layer of a checkpoint in plain PyTorch (see the module docstring)."""

    def __init__(self, directory):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32
        ).eval()
        cfg = self.model.config
        self.t = _mtp_tensors(directory, cfg.num_hidden_layers)
        self.layer = _decoder_layer(self.model, self.t, cfg.num_hidden_layers)
        self.eps = cfg.rms_norm_eps

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """float64 ``[L-1, V]``: row i predicts token i + 2 from tokens 0 .. i + 1."""
        t, eps, n = self.t, self.eps, len(ids) - 1  # MTP positions i = 0 .. L-2 see t_{i+1}
        hidden = self.model.model(ids[None]).last_hidden_state[0, :n]  # [n, H], final-normed
        emb = t["embed_tokens.weight"][ids[1:]]  # [n, H]: Emb(t_{i+1})
        x = torch.cat([_rms(emb, t["enorm.weight"], eps), _rms(hidden, t["hnorm.weight"], eps)], -1)
        x = (x @ t["eh_proj.weight"].T)[None]  # [1, n, H]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]  # causal, additive
        rope = self.model.model.rotary_emb(x, pos)
        x = self.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope)[0]
        return (
            _rms(x, t["shared_head.norm.weight"], eps) @ t["shared_head.head.weight"].T
        ).double()

    def metrics(self, sequences) -> tuple[float, float]:
        """(mtp_1_loss, mtp_1_acceptance_rate in percent) over a batch."""
        losses, hits = [], []
        for seq in sequences:
            if len(seq) < 3:
                continue  # no position has a token two ahead
            ids = torch.as_tensor(seq, dtype=torch.long)
            logits, target = self.logits(ids)[:-1], ids[2:]  # position i predicts t_{i+2}
            losses.append(torch.nn.functional.cross_entropy(logits, target, reduction="none"))
            hits.append(logits.argmax(-1) == target)
        return float(torch.cat(losses).mean()), 100.0 * float(torch.cat(hits).double().mean())

    def half_predicted(self, length: int, seed: int) -> np.ndarray:
        """A sequence whose even-position tokens (from 2 on) are the MTP layer's own argmax
        predictions (accepted) and odd ones random (mostly rejected): a rate near 50 %."""
        rng = np.random.default_rng(seed)
        ids = rng.integers(0, VOCAB, length)
        for k in range(2, length, 2):  # causal: t_k does not change predictions before it
            ids[k] = int(self.logits(torch.as_tensor(ids[: k + 1]))[k - 2].argmax())
        return ids


def _batch(seqs) -> ScoreBatch:
    return ScoreBatch(
        token_ids=np.concatenate(seqs),
        lengths=np.array([len(s) for s in seqs], dtype=np.int64),
        return_mtp_metrics=True,
    )


@pytest.fixture
def pgs():
    """Per test here, not per module: this module's other tests build engines of their
    own (``DistributedEngine.create`` sets Megatron's parallel state up), in any order."""
    yield from one_rank_parallel()


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_mtp_loss_and_acceptance_match_reference(hf_dirs, family):
    ref = MTPReference(hf_dirs[family])
    seqs = [*_sequences(), ref.half_predicted(24, seed=3)]
    got = engine_outputs([_batch(seqs)], model=f"hf:{hf_dirs[family]}")[0].mtp_metrics
    loss, rate = ref.metrics(seqs)
    assert set(got) == {"mtp_1_loss", "mtp_1_acceptance_rate"}
    assert loss > 1.0, "reference MTP loss too small to tell heads apart"
    assert abs(got["mtp_1_loss"] - loss) <= TOL * max(1.0, loss), (got, loss)
    positions = sum(max(len(s) - 2, 0) for s in seqs)
    assert 11 / positions * 100 <= rate < 50, "the predicted half must be accepted"
    # counts of exact argmax hits: equal (a flip would need a logit tie within fp32 noise)
    assert abs(got["mtp_1_acceptance_rate"] - rate) <= 1e-4, (got, rate)


def test_mtp_metrics_come_from_the_checkpoint(hf_dirs, tmp_path):
    """Other MTP weights (eh_proj scaled) -> another served loss, equal to its reference."""

    def edit(tensors):
        name = next(k for k in tensors if k.endswith("eh_proj.weight"))
        return {**tensors, name: tensors[name] * 0.5}

    src, dst = hf_dirs["deepseek_v3"], tmp_path / "other_mtp"
    _edit_mtp(src, dst, edit)
    seqs = _sequences()
    got = engine_outputs([_batch(seqs)], model=f"hf:{dst}")[0].mtp_metrics["mtp_1_loss"]
    loss, _ = MTPReference(dst).metrics(seqs)
    original, _ = MTPReference(src).metrics(seqs)
    assert abs(got - loss) <= TOL * max(1.0, loss) and abs(loss - original) > 1e-3


def _edit_mtp(src, dst, edit) -> None:
    """Copies a checkpoint, passing its MTP tensors through ``edit(dict) -> dict``."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    with safe_open(str(dst / "mtp.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(edit(tensors), str(dst / "mtp.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("copy_differs", "embed_tokens.weight' differs from 'model.embed_tokens.weight'"),
        ("missing", "'model.layers.3.eh_proj.weight'.*only in part.*--ignore-mtp-layers"),
    ],
)
def test_bad_mtp_layers_are_refused(hf_dirs, build, tmp_path, case, needle):
    from megascore.api.errors import CheckpointError
    from megascore.checkpoint import resolve_model

    def edit(tensors):
        if case == "copy_differs":
            name = next(k for k in tensors if k.endswith("embed_tokens.weight"))
            tensors[name] = tensors[name] + 1.0
        else:
            tensors = {k: v for k, v in tensors.items() if "eh_proj" not in k}
        return tensors

    _edit_mtp(hf_dirs["glm4_moe"], tmp_path / case, edit)
    if case == "missing":  # also drop it from the shard index
        import json

        index = tmp_path / case / "model.safetensors.index.json"
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if "eh_proj" not in k}
        index.write_text(json.dumps(data))
    cfg, load, _ = resolve_model(f"hf:{tmp_path / case}")
    with pytest.raises(CheckpointError, match=needle):
        load(build(cfg))

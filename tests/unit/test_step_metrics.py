"""Step-level MoE / MTP metrics (``metrics_reduction="step"``) on one gloo rank, in process.

(a) a batch scored in 1, 2 or 4 microbatches (and with pads) reports the same metrics
    (<= 1e-6);
(b) they equal a plain-torch computation of Megatron's formulas over the whole batch from
    the router logits of a single-microbatch forward (sequence-level loss per request
    sequence);
(c) Megatron's per-microbatch value stays available (``"microbatch"``): with one
    microbatch it equals the step value wherever a microbatch is the whole batch
    (the packed microbatch is Megatron's one "sequence", so not the sequence-level loss).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.transformer.moe.router import TopKRouter

from megascore.config import EngineConfig
from megascore.engine.schedule.forward import forward_microbatch, scoring_forward
from megascore.model.build import build_model
from megascore.model.config import builtin_model
from megascore_server.config_loader import load_serve_config
from tests.padded_rows import pack_rows

LENGTHS = [11, 1, 6, 3, 17, 2, 9, 5]
MOE = {"load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss"}
REL = 1e-6


@pytest.fixture(scope="module")
def model(pgs):
    cfg = dataclasses.replace(
        builtin_model("tiny-moe"),
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
        moe_aux_loss_coeff=[1e-2, 1e-3, 1e-3],
    )
    return build_model(cfg, EngineConfig(device="cpu"), pgs)


@pytest.fixture(scope="module")
def batch(model):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, model.vocab_size, (len(LENGTHS), max(LENGTHS)), generator=gen)
    return ids, torch.tensor(LENGTHS)


def _score(model, batch, microbatches: int, *, reduction="step", pad=1):
    """Metrics of the batch cut into ``microbatches`` contiguous runs of sequences."""
    ids, lens = batch
    runs = torch.arange(len(LENGTHS)).tensor_split(microbatches)
    with scoring_forward(
        model,
        return_moe_metrics=True,
        return_mtp_metrics=True,
        num_microbatches=microbatches,
        metrics_reduction=reduction,
    ) as metrics:
        for run in runs:
            packed = pack_rows(ids[run], lens[run], pad_individual_seqs_to_multiple_of=pad)
            forward_microbatch(model, packed, metrics_forward=True)
    return {**metrics.moe, **metrics.mtp}


def _assert_close(got: dict, want: dict, names) -> None:
    for name in names:
        assert got[name] == pytest.approx(want[name], rel=REL, abs=1e-9), name


def _router_logits(model, batch) -> dict[int, torch.Tensor]:
    """Router logits ``[T, E]`` of every MoE layer (tracker slot) in one microbatch."""
    logits = {}
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]

    def capture(router):
        gating = router.gating

        def hooked(inputs):
            out = gating(inputs)
            slot = router.layer_number - 1 + (model.config.num_layers * router.is_mtp_layer)
            logits[slot] = out.detach().reshape(-1, model.config.num_moe_experts).double()
            return out

        return hooked

    for router in routers:
        router.gating = capture(router)
    try:
        _score(model, batch, 1)
    finally:
        for router in routers:
            del router.gating
    return logits


def _balance(chosen: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor, k: int):
    """Switch load-balancing loss of the tokens ``rows``: E / (k T^2) sum_i c_i P_i."""
    t, experts = rows.sum(), scores.shape[1]
    return experts / (k * t * t) * (chosen[rows].sum(0) * scores[rows].sum(0)).sum()


def _plain_torch_metrics(model, batch) -> dict[str, float]:
    """Megatron's formulas over the whole batch, written out in torch (module docstring)."""
    cfg = model.config
    k = cfg.moe_router_topk
    lens = batch[1]
    seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
    pos = torch.cat([torch.arange(n) for n in lens.tolist()])
    sums = dict.fromkeys(MOE, 0.0)
    for slot, logits in _router_logits(model, batch).items():
        ahead = max(0, slot - cfg.num_layers + 1)  # MTP layer j routes positions j ahead
        real = pos + ahead < lens[seq]
        scores = torch.softmax(logits.float(), dim=-1).double()[real]  # [T, E]
        chosen = torch.zeros_like(scores).scatter(1, scores.topk(k, dim=1).indices, 1.0)

        everything = torch.ones(int(real.sum()), dtype=torch.bool)
        per_seq = [_balance(chosen, scores, seq[real] == s, k) for s in seq[real].unique()]
        sums["load_balancing_loss"] += _balance(chosen, scores, everything, k)
        sums["global_load_balancing_loss"] += _balance(chosen, scores, everything, k)
        sums["seq_load_balancing_loss"] += torch.stack(per_seq).mean()
        sums["z_loss"] += torch.logsumexp(logits[real], dim=-1).square().mean()
    layers = cfg.num_layers + cfg.mtp_num_layers  # every layer of tiny-moe is MoE
    return {name: float(value) / layers for name, value in sums.items()}


def test_metrics_do_not_depend_on_microbatches_or_pads(model, batch):
    one = _score(model, batch, 1)
    assert set(one) == MOE | {"mtp_1_loss", "mtp_1_acceptance_rate"}
    assert all(v > 0 for n, v in one.items() if n.endswith("loss")), one
    for microbatches in (2, 4):
        _assert_close(_score(model, batch, microbatches), one, one)
    _assert_close(_score(model, batch, 4, pad=4), one, one)


def test_step_metrics_equal_plain_torch_formulas(model, batch):
    want = _plain_torch_metrics(model, batch)
    _assert_close(_score(model, batch, 4), want, MOE)


def test_microbatch_reduction_is_megatrons_mean_over_microbatches(model, batch):
    step = _score(model, batch, 1)
    megatron = _score(model, batch, 1, reduction="microbatch")
    same = ("load_balancing_loss", "global_load_balancing_loss", "z_loss", "mtp_1_loss")
    _assert_close(megatron, step, (*same, "mtp_1_acceptance_rate"))
    # Megatron's sequence-level loss takes the packed microbatch for one sequence
    assert megatron["seq_load_balancing_loss"] == pytest.approx(
        megatron["load_balancing_loss"], rel=REL
    )
    assert step["seq_load_balancing_loss"] != pytest.approx(step["load_balancing_loss"], rel=1e-3)
    # ... and averages over microbatches: four of them report other values than one
    four = _score(model, batch, 4, reduction="microbatch")
    assert four["load_balancing_loss"] != pytest.approx(megatron["load_balancing_loss"], rel=1e-4)
    assert four["mtp_1_acceptance_rate"] == pytest.approx(megatron["mtp_1_acceptance_rate"])


def test_reduction_option(model, batch):
    assert EngineConfig().metrics_reduction == "step"
    config = load_serve_config(["--metrics-reduction", "microbatch"], environ={})
    assert config.engine.metrics_reduction == "microbatch"
    with pytest.raises(ValueError, match="metrics_reduction"):
        _score(model, batch, 1, reduction="token")
    with pytest.raises(ValueError, match="metrics_reduction"):
        EngineConfig(metrics_reduction="token")

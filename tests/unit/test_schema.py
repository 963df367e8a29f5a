"""The option / output table (``megascore.api.schema``) drives every layer.

A per-token output added to the table alone (no other product edit) is computed by the
engine step from the output head, mapped packed -> flat with its fill, merged across
requests, cut per request and joined back, and counted in the client's size estimate;
every option is a ``ScoreBatch`` attribute and an SDK ``ScoreOptions`` argument sent
under its name; the recipe of docs/architecture.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch.distributed as dist

from megascore.api import schema
from megascore.api.selection import concat_outputs, select_sequences
from megascore.api.types import ScoreBatch
from megascore.config import EngineConfig
from megascore.engine.schedule.step import StepConfig, StepGroups, run_step
from megascore.engine.schedule.step_output import finish_step
from megascore.model.build import build_model
from megascore.model.config import builtin_model
from megascore_client.inputs import make_batch
from megascore_client.splitting import ROUTING_VALUES_GUESS, ScoreOptions, response_bytes
from megascore_server.batch_assembly import merge_batches

# The most likely next token's logprob: the top-1 logprob, from the chunk's normaliser.
BEST = schema.Output(
    "best_logprob",
    schema.TOKEN,
    "float32",
    wire="best_logprob",
    sdk="best_logprob",
    wanted=lambda o: o.return_logprobs,
    fill=-7.0,
    head=lambda chunk: chunk.global_max - chunk.lse,
)


@pytest.fixture
def with_best(monkeypatch):
    monkeypatch.setattr(schema, "OUTPUTS", (*schema.OUTPUTS, BEST))


@pytest.fixture(scope="module")
def score(pgs):
    model = build_model(builtin_model("tiny"), EngineConfig(device="cpu"), pgs)
    groups = StepGroups(tp=pgs.tp, cp=pgs.cp, pp=pgs.pp, status=dist.group.WORLD)
    cfg = StepConfig(pad_multiple=4, chunk_tokens=5, vocab_size=512, device="cpu")
    return lambda batch: finish_step(batch, run_step(model, batch, groups, cfg))


def _batch(lengths, seed, **options) -> ScoreBatch:
    ids = np.random.default_rng(seed).integers(0, 512, sum(lengths))
    return ScoreBatch(token_ids=ids, lengths=np.array(lengths), **options)


def test_a_per_token_output_added_to_the_table_alone(with_best, score):
    a = _batch([7, 1, 12], 0, top_k=1)
    b = _batch([5, 9], 1, return_logprobs=False)
    out = score(a)
    # computed chunk by chunk, flat layout, fill at entry 0 of each sequence
    best = out.best_logprob
    assert best.dtype == np.float32 and best.shape == (a.num_tokens,)
    starts = a.offsets()[:-1]
    np.testing.assert_array_equal(best[starts], -7.0)
    rest = np.setdiff1d(np.arange(a.num_tokens), starts)
    np.testing.assert_allclose(best[rest], out.top_k_logprobs[rest, 0], rtol=0, atol=1e-6)
    assert (best[rest] >= out.logprobs[rest] - 1e-6).all()
    # merged with a request that does not want it, cut out per request and joined back
    step = merge_batches([(a, np.array([2, 0])), (b, np.array([0, 1])), (a, np.array([1]))])
    merged = score(step)
    assert "best_logprob" in merged.values
    parts = [
        (np.array([2, 0]), select_sequences(merged, step.lengths, np.array([0, 1]), a)),
        (np.array([1]), select_sequences(merged, step.lengths, np.array([4]), a)),
    ]
    joined = concat_outputs(parts, a.lengths)
    np.testing.assert_allclose(joined.best_logprob, best, rtol=0, atol=1e-5)
    only_b = select_sequences(merged, step.lengths, np.array([2, 3]), b)
    assert only_b.best_logprob is None and only_b.logprobs is None


# A per-token output that needs an input: the logprob of a caller-chosen id per token,
# doubled (so that it is not target_logprobs under another name). The table alone: an
# input the head reads and an output whose head reads it.
PROBE_IDS = schema.Input("probe_ids", schema.TOKEN, "int64", ndim=1, fill=0, head=True)
PROBE = schema.Output(
    "probe_logprobs",
    schema.TOKEN,
    "float32",
    wire="probe_logprobs",
    sdk="probe_logprobs",
    wanted=lambda o: getattr(o, "probe_ids", None) is not None,  # plain batches lack it
    dims=lambda o: (o.num_probe_ids,),
    head=lambda chunk: 2 * chunk.id_logprobs(chunk.inputs["probe_ids"]),
)


def test_a_per_token_output_that_needs_an_input_added_to_the_table_alone(monkeypatch, score):
    """The recipe of docs/architecture.md for an output with an input: the entries in the
    table (an Input with ``head=True``, an Output whose ``head`` reads
    ``chunk.inputs``) and nothing else in the engine; the input reaches the row that
    predicts each token, its trailing size the output's shape. Checked against the top-1
    of the same forward: the probe at the most likely id is twice its logprob."""
    monkeypatch.setattr(schema, "INPUTS", (*schema.INPUTS, PROBE_IDS))
    monkeypatch.setattr(schema, "OUTPUTS", (*schema.OUTPUTS, PROBE))
    # the typed batch: ScoreBatch declares its fields from the table when it is defined
    ProbeBatch = dataclasses.make_dataclass(  # noqa: N806
        "ProbeBatch", [("probe_ids", object, None)], bases=(ScoreBatch,), frozen=True
    )
    plain = _batch([7, 1, 12], 3, top_k=1)
    top1 = score(plain).top_k_ids[:, :1]
    other = (top1 + 1) % 512
    probes = np.concatenate([top1, other], axis=1)
    batch = ProbeBatch(**{f.name: getattr(plain, f.name) for f in dataclasses.fields(plain)})
    batch = dataclasses.replace(batch, probe_ids=probes)
    assert batch.num_probe_ids == 2 and "probe_logprobs" in [
        o.name for o in schema.head_outputs(batch)
    ]
    out = score(batch)
    got = out.probe_logprobs
    assert got.dtype == np.float32 and got.shape == (plain.num_tokens, 2)
    starts = plain.offsets()[:-1]
    rest = np.setdiff1d(np.arange(plain.num_tokens), starts)
    np.testing.assert_array_equal(got[starts], 0.0)  # the fill at entry 0
    np.testing.assert_allclose(got[rest, 0], 2 * out.top_k_logprobs[rest, 0], atol=1e-5)
    assert (got[rest, 1] <= got[rest, 0] + 1e-5).all()  # another id is no likelier
    # the same ids asked as target ids (the built-in output with an input) agree
    targets = score(dataclasses.replace(plain, target_ids=probes)).target_logprobs
    np.testing.assert_allclose(got[rest], 2 * targets[rest], atol=1e-5)


def test_without_the_entry_the_output_is_not_computed(score):
    out = score(_batch([6, 3], 2))
    assert "best_logprob" not in out.values
    with pytest.raises(AttributeError):
        _ = out.best_logprob


def test_every_output_and_option_is_declared_once():
    for table in (schema.OUTPUTS, schema.OPTIONS, schema.INPUTS):
        names = [entry.name for entry in table]
        assert len(names) == len(set(names)), names
    wires = [out.wire for out in schema.OUTPUTS]
    assert len(wires) == len(set(wires))
    fields = {f.name for f in dataclasses.fields(ScoreBatch)}
    assert {opt.name for opt in schema.OPTIONS} | {i.name for i in schema.INPUTS} <= fields


def test_the_client_sizes_a_response_from_the_table(monkeypatch):
    """Bytes per token and per sequence of what a request asks for (the split plan's
    estimate), a new output included."""
    k_ids = [np.zeros((3, 2), np.int64), np.zeros((2, 2), np.int64)]
    batch = make_batch([[1, 2, 3], [4, 5]], target_ids=k_ids)

    def size(**options):
        return response_bytes(ScoreOptions(**options), batch)

    # logprobs f32 + target logprobs f32 [K=2]; lengths echo + num_loss_tokens +
    # cached_tokens (int64)
    assert size(losses=()) == (4 + 4 * 2, 8 + 8 + 8, False)
    # + top-k ids i64 and logprobs f32 [k]; routing i32, its shape guessed; 2 losses f64
    assert size(top_k=3, return_routing=True, losses=("nll", "mean_nll")) == (
        4 + 8 + 3 * (8 + 4) + 4 * ROUTING_VALUES_GUESS,
        8 + 8 + 8 + 2 * 8,
        True,
    )
    monkeypatch.setattr(schema, "OUTPUTS", (*schema.OUTPUTS, BEST))
    assert size(losses=())[0] == 4 + 8 + 4
    assert size(losses=(), return_logprobs=False)[0] == 8


def test_every_option_is_a_batch_attribute_and_an_sdk_argument_of_its_name():
    batch = _batch([2], 0)
    sdk = {f.name for f in dataclasses.fields(ScoreOptions)}
    for opt in schema.OPTIONS:
        assert getattr(batch, opt.name) == opt.default
        if opt.name in sdk and isinstance(opt.default, bool):
            sent = ScoreOptions(**{opt.name: not opt.default}).to_proto()
            assert getattr(sent, opt.name) is (not opt.default), opt.name
            assert getattr(ScoreOptions().to_proto(), opt.name) is opt.default
    sent = ScoreOptions(top_k=4, losses="nll", metrics="mtp", weights_version="v7").to_proto()
    assert (sent.top_k, list(sent.losses), sent.weights_version) == (4, ["nll"], "v7")
    assert (sent.return_moe_metrics, sent.return_mtp_metrics) == (False, True)


def test_head_outputs_follow_the_options():
    names = lambda **kw: [o.name for o in schema.head_outputs(_batch([3], 0, **kw))]  # noqa: E731
    assert names() == ["logprobs"]
    assert names(return_logprobs=False) == []
    assert names(return_logprobs=False, losses=("nll",)) == ["logprobs"]
    assert names(top_k=2) == ["logprobs", "top_k_ids", "top_k_logprobs"]

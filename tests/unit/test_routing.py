"""MoE routing out and in on one rank: record, replay, checks (megascore.engine.outputs.routing).

The engine runs in-process on a world of one gloo rank (the layouts TP2 with SP, CP2
and EP2 are in tests/distributed/test_routing.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch.distributed as dist

from megascore.api.errors import InvalidRequestError
from megascore.api.limits import Limits, RoutingShape
from megascore.api.types import ScoreBatch
from megascore.config import EngineConfig
from megascore.engine.runtime import DistributedEngine

LENGTHS = np.array([5, 1, 17, 3, 9])


@pytest.fixture(scope="module")
def engine():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    eng = DistributedEngine.create(EngineConfig(model="tiny-moe", pad_to_multiple_of=8))
    yield eng
    eng.shutdown()
    if created:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def batch() -> ScoreBatch:
    rng = np.random.default_rng(3)
    return ScoreBatch(
        token_ids=rng.integers(0, 512, int(LENGTHS.sum())),
        lengths=LENGTHS,
        top_k=3,
        return_routing=True,
    )


@pytest.fixture(scope="module")
def recorded(engine, batch):
    return engine.score(batch)


def test_recorded_routing_shape_and_ids(engine, recorded):
    shape = RoutingShape(num_moe_layers=2, topk=2, num_experts=4)  # tiny-moe: 2 MoE layers
    assert engine.info().routing == shape
    routes = recorded.routing
    assert routes.dtype == np.int32 and routes.shape == (int(LENGTHS.sum()), 2, 2)
    shape.check(routes, LENGTHS)  # in range, distinct per token and layer
    assert len(np.unique(routes[:, 0, :], axis=0)) > 1  # not a constant route


def test_replaying_the_recorded_routing_is_bit_identical(engine, batch, recorded):
    out = engine.score(dataclasses.replace(batch, routing=recorded.routing))
    assert np.array_equal(out.logprobs, recorded.logprobs)
    assert np.array_equal(out.top_k_logprobs, recorded.top_k_logprobs)
    assert np.array_equal(out.top_k_ids, recorded.top_k_ids)
    assert np.array_equal(out.routing, recorded.routing)  # the replayed routes are returned


def test_replaying_another_routing_changes_exactly_the_later_tokens(engine, batch, recorded):
    """Token 4 of sequence 2 takes other experts in layer 0: only that sequence's entries
    after it change (entry t predicts token t from tokens < t); the rest stays bit-exact."""
    seq, pos = 2, 4
    t = int(LENGTHS[:seq].sum()) + pos
    routes = recorded.routing.copy()
    routes[t, 0] = [e for e in range(4) if e not in routes[t, 0]][:2]
    out = engine.score(dataclasses.replace(batch, routing=routes))
    changed = out.logprobs != recorded.logprobs
    end = int(LENGTHS[: seq + 1].sum())
    assert not changed[: t + 1].any() and not changed[end:].any()
    assert np.abs(out.logprobs[t + 1 : end] - recorded.logprobs[t + 1 : end]).max() > 1e-4


def test_routing_does_not_depend_on_the_batch(engine, batch, recorded):
    off = batch.offsets()
    alone = ScoreBatch(token_ids=batch.token_ids[off[2] : off[3]], lengths=LENGTHS[2:3])
    out = engine.score(dataclasses.replace(alone, return_routing=True))
    assert np.array_equal(out.routing, recorded.routing[off[2] : off[3]])


def test_metrics_forward_records_the_same_experts(engine, batch, recorded):
    """The training-mode forward of the metrics sorts its top-k; the experts are the same."""
    out = engine.score(dataclasses.replace(batch, return_moe_metrics=True))
    assert out.moe_metrics
    np.testing.assert_array_equal(np.sort(out.routing, -1), np.sort(recorded.routing, -1))
    replayed = engine.score(dataclasses.replace(batch, routing=out.routing))
    np.testing.assert_allclose(replayed.logprobs, recorded.logprobs, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("routing", "match"),
    [
        (np.zeros((34, 2, 2), np.int32), r"routing: shape must be \[num_tokens, num_moe_layers"),
        (np.zeros((35, 2), np.int32), "shape"),
        (np.full((35, 2, 2), 0.5), "integer"),
        (np.full((35, 2, 2), 7), r"sequence 0: expert ids must be in \[0, 4\)"),
        (np.zeros((35, 2, 2), np.int32), "sequence 0: .* distinct"),
    ],
)
def test_engine_rejects_bad_routing_before_any_collective(engine, batch, routing, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine.score(dataclasses.replace(batch, routing=routing))
    assert engine.score(batch).routing is not None  # still serving


def _valid(n: int = 10) -> np.ndarray:
    return np.tile(np.array([[0, 1], [2, 3]], np.int64), (n, 1, 1))


def test_routing_shape_check_names_the_sequence():
    shape, lengths = RoutingShape(2, 2, 4), np.array([3, 7])
    shape.check(_valid(), lengths)
    routes = _valid()
    routes[5, 1, 0] = 4
    with pytest.raises(InvalidRequestError, match=r"routing: sequence 1: expert ids must be in"):
        shape.check(routes, lengths)
    routes = _valid()
    routes[2, 0, 0] = -1
    with pytest.raises(InvalidRequestError, match="sequence 0: expert ids"):
        shape.check(routes, lengths)
    routes = _valid()
    routes[9, 1] = [3, 3]
    with pytest.raises(InvalidRequestError, match="sequence 1: .* must be distinct"):
        shape.check(routes, lengths)
    with pytest.raises(InvalidRequestError, match=r"\[10, 2, 2\], got \[10, 2, 3\]"):
        shape.check(np.zeros((10, 2, 3), np.int64), lengths)


def test_batch_check_refuses_routing_on_a_model_without_moe():
    dense = Limits(vocab_size=10, max_sequence_length=8, max_top_k=4, loss_names=("nll",))
    batch = ScoreBatch(token_ids=np.array([1, 2, 3]), lengths=np.array([3]))
    batch.check(dense)
    with pytest.raises(InvalidRequestError, match="options.return_routing: .* no MoE layers"):
        dataclasses.replace(batch, return_routing=True).check(dense)
    with pytest.raises(InvalidRequestError, match="^routing: .* no MoE layers"):
        dataclasses.replace(batch, routing=_valid(3)).check(dense)
    moe = dataclasses.replace(dense, routing=RoutingShape(2, 2, 4))
    dataclasses.replace(batch, routing=_valid(3), return_routing=True).check(moe)

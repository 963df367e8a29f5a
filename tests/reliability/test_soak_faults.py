"""Issue 36: the faults the changing-weights soak injects that no other test covered.

* **SIGTERM during a push** (the chaos loop's graceful kill, an orchestrator stopping a
  replica while a trainer pushes to the set): the victim's stream ends prepared, the
  drain refuses its commit (UNAVAILABLE "server shutting down"), so it never serves the
  new version, and the prepared push does not hold the stop. A push stream left open
  and idle across the SIGTERM (a trainer between two tensors) is ended UNAVAILABLE by
  the drain and dropped, as an idle ScoreStream is; it does not hold the stop.
* **SIGTERM right after a tensor completed** (seen once in the 60-minute run: the
  drain ended the push stream in the same turn of the event loop that queued the
  tensor's staging; the abort reached the engine first, the staging then found no
  open push and the replica reported itself broken): the staging is queued on the
  engine thread when it is asked for, so the abort always comes after it.
* **Staging memory after N pushes** (the trainer's push every few seconds, for hours):
  the host memory an engine keeps for the next push is one tensor per pushed
  parameter, of that parameter's size, however many pushes (full, partial, aborted)
  went before; the next push stages into it.

The other faults of the soak have their own tests already (docs/reliability.md,
"Changing-weights soak").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import grpc
import numpy as np
import pytest
import torch

from megascore.api.errors import UnavailableError, WorkerLostError
from megascore.api.types import LAYOUT_COMMON, WEIGHT_NAMES_MEGATRON
from megascore.config import EngineConfig
from megascore.engine.runtime import DistributedEngine
from megascore_server.batcher import DynamicBatcher
from megascore_server.gate import SHUTTING_DOWN_MESSAGE
from megascore_server.push.pusher import WeightPusher
from tests.one_rank import one_rank_world
from tests.service.harness import ServerThread, wait_for
from tests.service.test_weight_push import (
    NORM,
    PushEngine,
    begin,
    chunk,
    finish,
    prepared_push,
    push,
)


def test_sigterm_between_prepare_and_commit_refuses_the_commit_and_changes_nothing():
    """The soak's SIGTERM lands while a push to the set is open on the victim: its
    stream ends prepared, then the drain refuses the commit (FinishWeightUpdate
    UNAVAILABLE): the victim never serves the new version (the live replicas committed
    it; docs/client.md), its staged tensors are dropped, and the stop is not held."""
    server = ServerThread(PushEngine(), max_batch_wait_ms=1)
    try:
        prepared = push(server, prepared_push("v1"))
        assert prepared.prepared and prepared.push_id
        stopping = asyncio.run_coroutine_threadsafe(server.handles.stop(grace=30), server.loop)
        wait_for(lambda: server.handles.gate.draining, what="the drain")
        refused = finish(server, prepared.push_id)
        assert refused.code() is grpc.StatusCode.UNAVAILABLE, refused
        assert SHUTTING_DOWN_MESSAGE in refused.details()
        assert stopping.result(timeout=10) is True  # the prepared push holds no call open
        assert not any(e[0] == "commit" for e in server.engine.events)
        assert server.engine.version == "v0"
    finally:
        server.stop()


def test_sigterm_during_an_idle_push_stream_does_not_hold_the_drain():
    server = ServerThread(PushEngine(), max_batch_wait_ms=1)
    release = threading.Event()
    try:

        def stalled():  # a trainer between two tensors
            yield begin()
            yield chunk("norm", (5,), NORM)
            release.wait(60)

        future = server.stub().UpdateWeights.future(stalled(), timeout=60)
        wait_for(lambda: ("stage", "norm") in server.engine.events, what="the push staged")
        start = time.monotonic()
        assert server.call(server.handles.stop(grace=12), timeout=60) is True
        assert time.monotonic() - start < 6, "the open push held the drain"
        error = future.exception(timeout=30)
        assert error.code() is grpc.StatusCode.UNAVAILABLE, error
        assert server.engine.version == "v0"
    finally:
        release.set()
        server.stop()


class StrictPushEngine(PushEngine):
    """Refuses a staging without an open push, as every rank of the real engine does."""

    def __init__(self):
        super().__init__()
        self.open = False

    def begin_weight_update(self, names: int, weight_set: str = ""):
        self.open = True
        return super().begin_weight_update(names)

    def stage_weight(self, name, dtype, shape, data, layout):
        if not self.open:
            raise WorkerLostError("WEIGHTS_TENSOR without an open weight push")
        super().stage_weight(name, dtype, shape, data, layout)

    def abort_weight_update(self):
        self.open = False
        super().abort_weight_update()


def test_a_drain_right_after_a_tensor_completed_aborts_after_its_staging():
    """The drain ends a push stream in the same turn that queued a tensor's staging (no
    await between them): the abort follows the staging on the engine thread, the
    replica is not broken and keeps serving."""
    engine = StrictPushEngine()

    async def drained_after_a_tensor():  # what service._until_drain yields, then raises
        yield begin()
        yield chunk("norm", (5,), NORM)
        raise UnavailableError(SHUTTING_DOWN_MESSAGE)

    async def main():
        with concurrent.futures.ThreadPoolExecutor(1) as executor:
            batcher = DynamicBatcher(
                engine, executor, max_tokens_per_batch=64, max_batch_wait_ms=1, max_queue=4
            )
            with pytest.raises(UnavailableError, match="shutting down"):
                await WeightPusher().push(drained_after_a_tensor(), batcher)
            await asyncio.sleep(0.1)  # a staging queued late would run (and break) now
            await batcher.run_on_engine(lambda e: None)  # refused once the engine is lost

    asyncio.run(main())
    assert [e[0] for e in engine.events] == ["begin", "stage", "abort"]


@pytest.fixture(scope="module")
def engine():
    with one_rank_world():
        eng = DistributedEngine.create(
            EngineConfig(model="builtin:tiny-moe@1", device="cpu", collective_timeout_s=60)
        )
        yield eng
        eng.shutdown()


def _push(engine, tensors: dict, version: str, partial: bool, abort: bool = False):
    engine.begin_weight_update(WEIGHT_NAMES_MEGATRON)
    for name, tensor in tensors.items():
        data = bytearray(tensor.contiguous().numpy().tobytes())
        engine.stage_weight(name, "float32", tuple(tensor.shape), data, LAYOUT_COMMON)
    if abort:
        engine.abort_weight_update()
        return None
    return engine.commit_weights(version, partial)


def _kept(engine) -> dict[str, tuple[tuple, int]]:
    """What the engine keeps for the next push: name -> (shape, bytes)."""
    return {
        name: (tuple(t.shape), t.numel() * t.element_size())
        for name, t in engine._staging_buffers.items()
    }


def test_staging_memory_after_many_pushes_is_what_one_push_needs(engine):
    params = {
        k: v.detach().clone()
        for k, v in engine.loaded.model.state_dict().items()
        if not k.endswith("_extra_state") and v.is_floating_point()
    }
    some = dict(list(params.items())[:5])
    rng = torch.Generator().manual_seed(36)

    def changed(tensors):
        return {k: v + 0.01 * torch.randn(v.shape, generator=rng) for k, v in tensors.items()}

    assert _push(engine, changed(params), "full-1", partial=False) == "full-1"
    one_push = _kept(engine)
    sizes = {name: (tuple(t.shape), t.numel() * t.element_size()) for name, t in params.items()}
    assert set(one_push) <= set(sizes) and all(one_push[n] == sizes[n] for n in one_push)
    assert sum(b for _, b in one_push.values()) <= sum(b for _, b in sizes.values())
    for i in range(12):  # full, partial and aborted pushes, as the soak's trainer sends
        if i % 3 == 0:
            _push(engine, changed(params), f"full-{i}", partial=False)
        elif i % 3 == 1:
            _push(engine, changed(some), f"part-{i}", partial=True)
        else:
            _push(engine, changed(some), f"aborted-{i}", partial=True, abort=True)
        kept = _kept(engine)
        assert set(kept) <= set(sizes), set(kept) - set(sizes)
        assert all(kept[n] == sizes[n] for n in kept), i
        assert sum(b for _, b in kept.values()) <= sum(b for _, b in one_push.values()), i
    final = {name: t.detach().clone() for name, t in params.items()}
    _push(engine, final, "last", partial=False)
    served = engine.loaded.model.state_dict()
    for name, tensor in final.items():
        assert torch.equal(served[name], tensor), name
    assert np.isfinite(sum(b for _, b in _kept(engine).values()))

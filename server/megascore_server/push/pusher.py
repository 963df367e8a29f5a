"""``UpdateWeights``: a client stream of named tensors, staged on every rank, swapped at once.

Torch-free. The stream is ``begin``, the tensors as ``chunk``s (or several pieces to a
message as ``chunks``, each taken as a lone ``chunk``), then ``commit``
(``protos/megascore/v1/scoring.proto``). :class:`~.chunks.PushSession` checks every chunk
against the targets the engine listed at ``begin`` (name, full shape, float
dtype, byte offsets, one expert layout) and reassembles each tensor; each
complete tensor goes to the engine thread (``DynamicBatcher.run_on_engine``),
where every rank stages its shard while the batcher keeps scoring on the old
weights (tensors stage while the next ones arrive). The commit is a batcher
barrier (``DynamicBatcher.swap_weights``). Anything else — a bad chunk, a
stream that ends without commit or is cancelled, a rank that cannot commit —
drops the staged tensors on every rank and leaves the old weights serving.

One push at a time per server: a second one is refused with
:class:`~megascore.api.errors.ConflictError` (ABORTED) until the first has ended
(and its staged tensors were dropped).

Two phases (``commit.prepare``): the stream ends once every tensor is staged and the
push checked complete, answering ``prepared`` and a ``push_id``; the staged tensors
stay on the ranks (and the push keeps the server's one push slot) until
:meth:`WeightPusher.finish` commits or aborts it, or ``prepare_timeout_s`` passes
without one and it is dropped.

Deltas (``begin.base_weights_version``): a push with ``begin.keep`` leaves rank 0 a host
copy of its tensors (in their pushed dtype); a later delta against the version it
produced sends only what changed — whole tensors, or one-chunk patches of (index,
value) pairs applied to the kept copy bit for bit — and is then staged and swapped
as any push (tensors not sent keep their values). A delta against a version the
replica does not serve, or did not keep, is refused at ``begin`` with
FAILED_PRECONDITION (the SDK then pushes in full).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time
import uuid

from megascore.api.errors import (
    ConflictError,
    FailedPreconditionError,
    InvalidRequestError,
    WrongVersionError,
    quoted,
)
from megascore.api.types import ModelInfo
from megascore.v1 import scoring_pb2 as pb
from megascore_server.batcher import DynamicBatcher
from megascore_server.push.chunks import (
    DTYPES,
    STAGING_BYTES,
    PushedTensor,
    PushSession,
    TensorBuffers,
)
from megascore_server.push.target import PushTarget
from megascore_server.validation import MAX_ID_CHARS, check_length

logger = logging.getLogger(__name__)


def new_weights_version() -> str:
    """A generated version label: ``push-`` + 12 hex digits."""
    return "push-" + uuid.uuid4().hex[:12]


PREPARE_TIMEOUT_S = 60.0
"""How long a prepared push is held without a FinishWeightUpdate (``prepare_timeout_s``
0); at most :data:`MAX_PREPARE_TIMEOUT_S`."""
MAX_PREPARE_TIMEOUT_S = 3600.0


@dataclasses.dataclass
class _Prepared:
    """A push staged on every rank, waiting for its commit or abort."""

    push_id: str
    version: str
    partial: bool
    response: pb.UpdateWeightsResponse
    expiry: asyncio.TimerHandle
    session: PushSession
    base_version: str
    target: PushTarget


def _prepare_timeout(commit: pb.UpdateWeightsCommit) -> float:
    timeout = commit.prepare_timeout_s
    if not (math.isfinite(timeout) and 0 <= timeout <= MAX_PREPARE_TIMEOUT_S):
        raise InvalidRequestError(
            f"commit.prepare_timeout_s: {timeout} is outside [0, {MAX_PREPARE_TIMEOUT_S:g}]"
        )
    return timeout or PREPARE_TIMEOUT_S


class WeightPusher:
    """Runs UpdateWeights streams against the batcher's engine, one at a time."""

    def __init__(self):
        self._buffers = TensorBuffers(2 * STAGING_BYTES)
        self._busy = False
        self._prepared: _Prepared | None = None
        self._kept: tuple[str, dict[str, tuple]] | None = None  # (version, tensors)

    async def push(
        self, requests, batcher: DynamicBatcher
    ) -> tuple[pb.UpdateWeightsResponse, ModelInfo | None]:
        """Consumes one UpdateWeights stream; returns the response and the model info after
        the swap (None when the push was only prepared).

        Raises:
            ConflictError: another push is in progress, or the stream ended without commit.
            InvalidRequestError: a malformed stream or a tensor that does not fit.
            CheckpointError: some rank could not commit (nothing changed).
        """
        start = time.monotonic()
        iterator = aiter(requests)
        # busy from the first message: a stream that has sent nothing holds no push
        first = await anext(iterator, None)
        if self._busy:
            raise ConflictError(
                "another UpdateWeights is in progress on this server; retry when it ends"
            )
        self._busy = True
        opened = settled = False  # settled: the engine no longer holds this push's tensors
        release = True
        try:
            target, base = self._check_begin(first, batcher)
            base_version = first.begin.base_weights_version
            opened = True
            targets = await batcher.run_on_engine(target.open)
            session = PushSession(
                targets, target.names, base=base, keep=first.begin.keep, buffers=self._buffers
            )
            commit = await self._stage_all(iterator, session, batcher)
            # an adapter carries the modules it adapts; it replaces the adapter whole
            partial = commit.partial or base is not None or bool(target.adapter)
            session.check_complete(partial)
            check_length("commit.weights_version", commit.weights_version, MAX_ID_CHARS)
            stream_ms = (time.monotonic() - start) * 1e3
            version = commit.weights_version or new_weights_version()
            if commit.prepare:
                response = _response(
                    session,
                    weights_version=version,
                    previous_weights_version=_version(batcher, target.served),
                    stream_ms=stream_ms,
                    prepared=True,
                    push_id=uuid.uuid4().hex,
                )
                hold_s = _prepare_timeout(commit)
                self._hold(response, partial, hold_s, batcher, session, base_version, target)
                settled, release = True, False  # held until finish() or the timeout
                return response, None
            settled = True  # the commit drops the staged tensors on every rank, ok or not
            new, previous, info = await batcher.swap_weights(
                _commit_call(version, partial, base_version, target.served), target.served
            )
            self._remember(new, session, target)
            swap_ms = (time.monotonic() - start) * 1e3 - stream_ms
        except asyncio.CancelledError:
            if opened and not settled:  # the next push may start once every rank dropped it
                release = False
                aborting = asyncio.ensure_future(self._abort(batcher))
                aborting.add_done_callback(lambda _: setattr(self, "_busy", False))
            raise
        except BaseException:
            if opened and not settled:  # dropped before the error is answered: a retry works
                await self._abort(batcher)
            raise
        finally:
            if release:
                self._busy = False
        return _pushed(session, new, previous, stream_ms, swap_ms), info

    def _check_begin(self, first, batcher: DynamicBatcher) -> tuple[PushTarget, dict | None]:
        """The target and the delta base (None: a full push) of a stream's first message,
        checked before anything is opened on the engine.

        Raises:
            InvalidRequestError: the stream does not start with a valid begin.
            WrongVersionError, FailedPreconditionError: a delta this replica cannot take.
        """
        if first is None or first.WhichOneof("step") != "begin":
            raise InvalidRequestError("message 0: an UpdateWeights stream starts with begin")
        target = PushTarget.from_begin(first.begin)
        base_version = first.begin.base_weights_version
        base = self._delta_base(base_version, batcher, target) if base_version else None
        return target, base

    def _delta_base(self, base_version: str, batcher, target: PushTarget) -> dict[str, tuple]:
        """The kept tensors a delta against ``base_version`` patches.

        Raises:
            WrongVersionError: the replica serves another version.
            FailedPreconditionError: it kept no copy of the version it serves.
        """
        served = _version(batcher, target.served)
        if base_version != served:
            raise WrongVersionError(
                f"begin.base_weights_version: a delta against weights {quoted(base_version)}, "
                f"this replica serves {quoted(served)}; push in full"
            )
        if self._kept is None or self._kept[0] != served:
            raise FailedPreconditionError(
                f"begin.base_weights_version: this replica kept no copy of weights "
                f"{quoted(served)} (a push with begin.keep makes one); push in full"
            )
        return self._kept[1]

    def forget_kept(self) -> None:
        """Drops the kept copies (the weights were loaded from elsewhere)."""
        self._kept = None

    def _remember(self, version: str, session: PushSession, target: PushTarget) -> None:
        """After a commit: the kept copies are this push's (over its base's for a delta),
        or none without ``keep``; an adapter's push leaves them as they were."""
        if target.adapter:
            return
        if session.keep:
            self._kept = (version, {**(session.base or {}), **session.kept})
        else:
            self._kept = None

    def _hold(self, response, partial: bool, hold_s: float, batcher, session, base, target) -> None:
        push_id = response.push_id
        expiry = asyncio.get_running_loop().call_later(
            hold_s, lambda: asyncio.ensure_future(self._expire(push_id, hold_s, batcher))
        )
        self._prepared = _Prepared(
            push_id, response.weights_version, partial, response, expiry, session, base, target
        )
        logger.info(
            "weights %r prepared (push %s): %d tensors, %d bytes; held %.0f s for its commit",
            response.weights_version, push_id, response.num_tensors, response.num_bytes, hold_s,
        )  # fmt: skip

    async def _expire(self, push_id: str, hold_s: float, batcher: DynamicBatcher) -> None:
        prepared = self._prepared
        if prepared is None or prepared.push_id != push_id:
            return
        self._prepared = None
        logger.warning(
            "prepared push %s (weights %r) heard nothing for %.0f s: dropped",
            push_id, prepared.version, hold_s,
        )  # fmt: skip
        try:
            await self._abort(batcher)
        finally:
            self._busy = False

    async def finish(
        self, push_id: str, commit: bool, batcher: DynamicBatcher
    ) -> tuple[pb.UpdateWeightsResponse, ModelInfo | None]:
        """Commits (swaps in) or aborts (drops) the prepared push ``push_id``; returns the
        response and the model info after a commit (None after an abort).

        Raises:
            FailedPreconditionError: no push of that id is prepared.
            CheckpointError: some rank could not commit (nothing changed).
        """
        prepared = self._prepared
        if prepared is None or prepared.push_id != push_id:
            raise FailedPreconditionError(
                f"push_id: no prepared push {quoted(push_id)} on this replica (never "
                "prepared, already finished, or dropped after its prepare_timeout_s)"
            )
        self._prepared = None
        prepared.expiry.cancel()
        response = pb.UpdateWeightsResponse()
        response.CopyFrom(prepared.response)
        response.prepared = False
        start = time.monotonic()
        try:
            if not commit:
                await self._abort(batcher)
                response.weights_version = _version(batcher, prepared.target.served)
                response.previous_weights_version = response.weights_version
                logger.info("prepared push %s aborted", push_id)
                return response, None
            served = prepared.target.served
            new, previous, info = await batcher.swap_weights(
                _commit_call(prepared.version, prepared.partial, prepared.base_version, served),
                served,
            )
            self._remember(new, prepared.session, prepared.target)
        finally:
            self._busy = False
        response.weights_version, response.previous_weights_version = new, previous
        response.swap_ms = (time.monotonic() - start) * 1e3
        logger.info("weights %r -> %r committed (push %s)", previous, new, push_id)
        return response, info

    async def _stage_all(self, iterator, session: PushSession, batcher: DynamicBatcher):
        """Reads chunks up to the commit, staging each complete tensor on the engine thread
        while the next ones arrive (at most ``STAGING_BYTES`` of tensors waiting there; the
        tensors one message completes in one call). Each staging is queued on the engine
        thread when its message was read, so an abort after an error here runs after every
        staging asked for."""
        staging: collections.deque[tuple[asyncio.Future, int]] = collections.deque()
        index = 0
        async for message in iterator:
            index += 1
            kind = message.WhichOneof("step")
            if kind == "commit":
                while staging:
                    await staging[0][0]
                    staging.popleft()
                return message.commit
            if kind == "chunk":
                pieces = [(message.chunk, index)]
            elif kind == "chunks":  # each piece as if it came alone
                pieces = [
                    (chunk, f"{index} (piece {i} of {len(message.chunks.chunks)})")
                    for i, chunk in enumerate(message.chunks.chunks, 1)
                ]
            else:
                raise InvalidRequestError(f"message {index}: {kind} inside a push")
            tensors = []  # those the message completes: one engine call stages them
            for chunk, where in pieces:
                tensor = session.add(chunk, where)
                if tensor is not None and not tensor.ignored:
                    tensors.append(tensor)
            if not tensors:
                continue
            size = sum(t.total for t in tensors)
            while staging and sum(n for _, n in staging) + size > STAGING_BYTES:
                await staging[0][0]
                staging.popleft()
            future = batcher.run_on_engine(_stage_call(tensors))
            staging.append((future, size))
        raise ConflictError(
            f"the stream ended after {index + 1} messages without a commit; "
            "nothing changed (the old weights keep serving)"
        )

    @staticmethod
    async def _abort(batcher: DynamicBatcher) -> None:
        try:
            await batcher.run_on_engine(lambda e: e.abort_weight_update())
        except Exception as exc:  # noqa: BLE001 - the batcher reports a lost engine itself
            logger.warning("dropping an unfinished weight push failed: %s", exc)


def _response(session: PushSession, **fields) -> pb.UpdateWeightsResponse:
    """The answer to a push: what it carried, and ``fields``."""
    return pb.UpdateWeightsResponse(
        num_tensors=len(session.received), num_bytes=session.num_bytes, **fields
    )


def _pushed(
    session: PushSession, new: str, previous: str, stream_ms: float, swap_ms: float
) -> pb.UpdateWeightsResponse:
    """Logs a push swapped in and answers it."""
    logger.info(
        "weights %r -> %r pushed: %d tensors, %d bytes in %.0f ms (+%.0f ms swap)",
        previous,
        new,
        len(session.received),
        session.num_bytes,
        stream_ms,
        swap_ms,
    )
    return _response(
        session,
        weights_version=new,
        previous_weights_version=previous,
        stream_ms=stream_ms,
        swap_ms=swap_ms,
    )


def _version(batcher: DynamicBatcher, served: str) -> str:
    """The version of the set or adapter ``served`` names now ("" for a new adapter)."""
    models = batcher.engine_info().models
    if not served or not models:
        return batcher.weights_version
    return next((m.weights_version for m in models if m.name == served), "")


def _commit_call(version: str, partial: bool, base_version: str, target: str):
    """The swap of a push's commit; a delta's base must still be the version the target
    serves (else its staged tensors are dropped and :class:`WrongVersionError` raised)."""

    def commit(engine) -> str:
        served = engine.info().served(target).weights_version if base_version else ""
        if base_version and served != base_version:  # (a new adapter is not served yet)
            engine.abort_weight_update()
            raise WrongVersionError(
                f"begin.base_weights_version: weights {quoted(served)} were loaded during "
                f"the delta against {quoted(base_version)}; push in full"
            )
        return engine.commit_weights(version, partial)

    return commit


def _stage_call(tensors: list[PushedTensor]):
    """Stages ``tensors`` in order, in one call on the engine thread (a packed message's
    small tensors pay one hop there, not one each)."""

    def stage(engine) -> None:
        for t in tensors:
            engine.stage_weight(t.name, DTYPES[t.dtype][0], t.shape, t.data, t.layout)

    return stage

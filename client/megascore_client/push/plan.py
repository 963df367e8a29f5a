"""What ``push_weights`` does, written once for the sync and the asyncio client.

:func:`push_steps` is the logic without I/O: which replicas a push goes to, the one
version label of a push to several, and delta pushes (the base each replica set kept,
the fallback to a full push when a replica refuses the delta). It is a generator that
yields each push to run (a :class:`PushCall`) and is sent that push's
:class:`~megascore_client.push.requests.PushResult`, or thrown its
:class:`~megascore_client.errors.ScoringError`; :func:`run_steps` (sync) and
:func:`run_steps_async` (asyncio) drive it, each client running the pushes over its
own transport (one replica: one ``UpdateWeights`` stream; several:
:func:`megascore_client.push.replicas.push_to_replicas`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Generator

import grpc

from megascore_client.errors import ScoringError
from megascore_client.push.replicas import new_push_version, replica_targets
from megascore_client.push.requests import PushResult

logger = logging.getLogger(__name__)

__all__ = ["PushCall", "push_steps", "run_steps", "run_steps_async"]

DeltaBases = dict[tuple[str, ...], tuple[str, dict]]
"""A client's kept delta bases: replica targets -> (version they kept, its tensors)."""


@dataclasses.dataclass
class PushCall:
    """One push of a ``push_weights`` call.

    Attributes:
        named_tensors: the ``(name, tensor)`` pairs.
        targets: the replicas, all or none when :attr:`several`.
        options: the keywords of ``PushBase._push_requests``
            (:mod:`megascore_client.push.client_methods`).
    """

    named_tensors: object
    targets: list[str]
    options: dict

    @property
    def several(self) -> bool:
        """Two phases (a prepared state on every replica, then the commits)."""
        return self.options["prepare_timeout_s"] is not None


Steps = Generator[PushCall, PushResult, PushResult]


def push_steps(
    bases: DeltaBases,
    target: str,
    named_tensors,
    *,
    weights_version: str = "",
    version: str | None = None,
    names: str = "hf",
    partial: bool = False,
    chunk_bytes: int | None = None,
    progress=None,
    replicas=None,
    prepare_timeout_s: float = 60.0,
    delta: bool = False,
    weight_set: str = "",
    adapter: str = "",
    adapter_config: str = "",
    begin: dict | None = None,
) -> Steps:
    """The pushes of one ``push_weights`` call (arguments: its own; ``target`` the
    client's, ``bases`` the client's kept delta bases, updated here).

    Returns:
        The call's result (a delta's ``delta`` set when it went as one).
    """
    targets = replica_targets(target) if replicas is None else list(replicas)
    several = replicas is not None or len(targets) > 1
    options = dict(
        weights_version=weights_version, version=version, names=names, partial=partial,
        chunk_bytes=chunk_bytes, progress=progress,
        prepare_timeout_s=prepare_timeout_s if several else None,
        begin=begin or dict(weight_set=weight_set, adapter=adapter, adapter_config=adapter_config),
    )  # fmt: skip
    if several and not (weights_version or version):
        options["weights_version"] = new_push_version()  # one label for every replica
    key = tuple(targets)
    if not delta:
        if not options["begin"]["adapter"]:  # an adapter's push leaves the sets' bases
            bases.pop(key, None)
        return (yield PushCall(named_tensors, targets, options))
    named, base = list(named_tensors), bases.pop(key, None)
    result = None
    if base is not None:
        kept: dict = {}
        try:
            result = yield PushCall(named, targets, dict(options, base=base, kept=kept))
            kept = {**base[1], **kept}
        except ScoringError as exc:
            if exc.code is not grpc.StatusCode.FAILED_PRECONDITION:
                raise
            logger.info("delta push refused (%s): pushing in full", exc.details)
    if result is None:
        kept = {}
        result = yield PushCall(named, targets, dict(options, kept=kept))
        base = None
    bases[key] = (result.weights_version, kept)
    return dataclasses.replace(result, delta=base is not None)


def _advance(steps: Steps, outcome: PushResult | ScoringError | None):
    """Hands ``outcome`` (None first) to ``steps``: the next :class:`PushCall`, or
    ``(result,)`` when the call is done."""
    try:
        if outcome is None:
            return next(steps)
        if isinstance(outcome, ScoringError):
            return steps.throw(outcome)
        return steps.send(outcome)
    except StopIteration as stop:
        return (stop.value,)


def run_steps(steps: Steps, run: Callable[[PushCall], PushResult]) -> PushResult:
    """Drives :func:`push_steps` with ``run(call)`` (blocking)."""
    outcome = None
    while isinstance(call := _advance(steps, outcome), PushCall):
        try:
            outcome = run(call)
        except ScoringError as exc:
            outcome = exc
    return call[0]


async def run_steps_async(
    steps: Steps, run: Callable[[PushCall], Awaitable[PushResult]]
) -> PushResult:
    """Drives :func:`push_steps` with ``await run(call)``."""
    outcome = None
    while isinstance(call := _advance(steps, outcome), PushCall):
        try:
            outcome = await run(call)
        except ScoringError as exc:
            outcome = exc
    return call[0]

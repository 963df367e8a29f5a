"""One weight push to every replica of a target, all or none (two phases).

``push_weights`` to a target naming several replicas (``ipv4:a,b``, ``ipv6:...``, a
``dns:///`` name resolving to several addresses, or an explicit ``replicas=`` list)
runs :func:`push_to_replicas`:

1. **Prepare**: the messages of the push, produced once, are streamed to every replica
   at the same time (one bounded queue per replica: the slowest paces the others),
   ending with a commit marked ``prepare``. Each replica stages and checks every
   tensor and answers ``prepared`` with a ``push_id``, keeping its old weights.
2. **Commit**: only when every replica prepared, ``FinishWeightUpdate(commit)`` goes to
   all of them at once. When any replica failed to prepare (refused a tensor, died,
   timed out), the others' streams are cancelled or their prepared pushes aborted
   (``FinishWeightUpdate(commit=False)``): no replica switches, and the error names
   the replica and its status. A replica that never hears back drops its prepared
   push after ``prepare_timeout_s``.

Between the first and the last replica's commit (one round trip) the replicas serve
different versions; requests pinned to the new version (``weights_version=``) are
only ever answered by it. A replica that fails *in* the commit phase (after every one
prepared) leaves the others committed: the error names it and says which committed.

Both clients run this one implementation (``megascore_client.push.plan``): the sync
client in the calling thread, the asyncio client in a worker thread (the event loop
keeps running; a cancelled ``await client.push_weights(...)`` aborts the push on every
replica unless the commits began).
"""

from __future__ import annotations

import dataclasses
import queue
import socket
import threading
import time
import uuid
from urllib.parse import urlsplit

import grpc

from megascore.v1 import scoring_pb2 as pb
from megascore_client.channel import ChannelSettings
from megascore_client.errors import ScoringError
from megascore_client.push.requests import PushResult, finish
from megascore_client.transport import SyncTransport

__all__ = [
    "LOOKUP_S",
    "new_push_version",
    "push_to_replicas",
    "replica_targets",
    "tensor_chunks_answer",
    "tensor_chunks_lookup",
]

_QUEUE_MESSAGES = 4  # messages waiting per replica (each up to one chunk)
_END = None


def new_push_version() -> str:
    """The version of a push to several replicas that names none: ``push-`` + 12 hex
    digits, chosen by the client so that every replica serves the same label."""
    return "push-" + uuid.uuid4().hex[:12]


def replica_targets(target: str) -> list[str]:
    """The replicas a gRPC target names: each address of an ``ipv4:`` / ``ipv6:`` list,
    each address a ``dns:`` name resolves to (``host:port``), else the target itself."""
    scheme, _, rest = target.partition(":")
    if scheme in ("ipv4", "ipv6") and rest:
        return [address for address in rest.split(",") if address]
    if scheme == "dns" and rest:
        path = urlsplit(target).path.lstrip("/") if rest.startswith("//") else rest
        host, _, port = path.rpartition(":")
        if not host or not port.isdigit():
            return [target]
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        addresses = dict.fromkeys(info[4][0] for info in infos)
        return [f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addresses]
    return [target]


@dataclasses.dataclass
class _Replica:
    target: str
    transport: SyncTransport
    messages: queue.Queue
    future: grpc.Future | None = None
    prepared: pb.UpdateWeightsResponse | None = None
    error: ScoringError | None = None

    def requests(self):
        while (message := self.messages.get()) is not _END:
            yield message

    def put(self, message, deadline: float, cancelled: threading.Event) -> bool:
        """Queues ``message`` for this replica's stream; False once its call has ended
        (or the deadline passed, or the push was cancelled, while the queue was full)."""
        while not self.future.done():
            try:
                self.messages.put(message, timeout=0.05)
                return True
            except queue.Full:
                if time.monotonic() > deadline or cancelled.is_set():
                    return False
        return False


def push_to_replicas(
    settings: ChannelSettings,
    replicas: list[str],
    requests,
    counters: dict,
    deadline: float,
    cancelled: threading.Event | None = None,
) -> PushResult:
    """Pushes ``requests`` (one push's messages, its commit marked ``prepare``; they fill
    ``counters``, see :func:`megascore_client.push.requests.push_requests`) to every replica, then
    commits on all of them only when all prepared. Blocking; the asyncio client runs it
    in a thread.

    Args:
        settings: the client's channel settings (each replica gets a channel of its own).
        replicas: the targets.
        requests: the messages, consumed once.
        counters: what ``requests`` fills (their own error is raised first).
        deadline: ``time.monotonic()`` deadline of the whole push.
        cancelled: set by the caller to give up: before every replica prepared, the
            push is aborted everywhere (CANCELLED); once the commits began, they finish.

    Returns:
        The first replica's result, ``replicas`` holding every one's in order.

    Raises:
        ScoringError: a replica failed to prepare (no replica switched), or to commit
            (the details say which replicas committed); its code, target and status.
        InvalidInputError: a tensor that cannot be pushed (no replica switched).
    """
    start = time.perf_counter()
    cancelled = cancelled or threading.Event()
    group = [
        _Replica(target, SyncTransport(_one(settings, target)), queue.Queue(_QUEUE_MESSAGES))
        for target in replicas
    ]
    try:
        for replica in group:
            replica.future = replica.transport.start(
                replica.transport.stub.UpdateWeights, replica.requests(), deadline
            )
        error = _prepare(group, requests, deadline, cancelled)
        if error is not None:
            _abort(group, deadline)
            switched = f"no replica switched (pushed to {len(group)}: {', '.join(replicas)})"
            finish(ScoringError(error.code, f"{error.details}; {switched}"), counters, 0.0)
        return _commit(group, deadline, start)
    finally:
        for replica in group:
            replica.transport.close()


LOOKUP_S = 10.0
"""How long the lookup of whether a push's replicas take packed messages may take."""


def tensor_chunks_answer(info: pb.ModelInfo | None, error: ScoringError | None) -> bool | None:
    """What one replica's GetModelInfo answer (or error) says of packed push messages
    (``UpdateWeightsRequest.chunks``): True with ``ModelInfo.accepts_tensor_chunks``, False
    for a server from before it (the field unset, or no GetModelInfo at all), None when
    the replica could not be asked (nothing learned: the push sends one piece a message)."""
    if error is None:
        return bool(info.accepts_tensor_chunks)
    return False if error.code is grpc.StatusCode.UNIMPLEMENTED else None


def tensor_chunks_lookup(settings: ChannelSettings, targets: list[str], deadline: float):
    """Whether every replica of a push to ``targets`` takes packed messages (see
    :func:`tensor_chunks_answer`; None when some replica could not be asked)."""
    answers = []
    for target in targets:
        transport = SyncTransport(_one(settings, target))
        try:
            info = transport.call(transport.stub.GetModelInfo, pb.GetModelInfoRequest(), deadline)
            answers.append(tensor_chunks_answer(info, None))
        except ScoringError as exc:
            answers.append(tensor_chunks_answer(None, exc))
        finally:
            transport.close()
        if answers[-1] is False:
            return False
    return None if None in answers else True


def _one(settings: ChannelSettings, target: str) -> ChannelSettings:
    return dataclasses.replace(settings, target=target, load_balancing=None)


def _prepare(
    group: list[_Replica], requests, deadline: float, cancelled: threading.Event
) -> ScoringError | None:
    """Streams every message to every replica, then collects their prepare answers.

    Returns:
        The error of the replica that failed first (its call ended before the push did,
        or it refused the push), naming it; CANCELLED when ``cancelled`` was set before every
        replica answered; None when every replica prepared.
    """
    cause = None
    for message in requests:
        if cancelled.is_set():
            break
        cause = next((r for r in group if not r.put(message, deadline, cancelled)), None)
        if cause is not None:
            break  # the others' streams end without a commit: they drop what they staged
    for replica in group:
        if not replica.future.done():
            if cancelled.is_set():
                replica.future.cancel()  # the replica drops what it staged
            else:
                replica.put(_END, deadline, cancelled)
    for replica in group:
        while not (replica.future.done() or cancelled.wait(0.05)):
            pass
        if cancelled.is_set():
            replica.future.cancel()  # a no-op once answered
        if replica.future.cancelled():
            continue  # cancelled before its answer: the replica drops what it staged
        try:
            replica.prepared = replica.transport.result(replica.future)
            if not replica.prepared.prepared:
                replica.error = ScoringError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "the server does not support two-phase pushes (no prepared state); "
                    "it committed on its own",
                )
        except ScoringError as exc:
            replica.error = exc
    if cancelled.is_set():
        return ScoringError(grpc.StatusCode.CANCELLED, "the push was cancelled")
    if cause is None:
        cause = next((r for r in group if r.error is not None), None)
    if cause is None:
        return None
    error = cause.error or ScoringError(
        grpc.StatusCode.DEADLINE_EXCEEDED, "the push's timeout passed"
    )
    return ScoringError(
        error.code, f"weight push to replica {cause.target} failed: {error.details}"
    )


def _finish(group: list[_Replica], commit: bool, deadline: float) -> dict:
    """``FinishWeightUpdate`` on every prepared replica at once: target -> response or error."""
    calls = {
        replica.target: replica.transport.start(
            replica.transport.stub.FinishWeightUpdate,
            pb.FinishWeightUpdateRequest(push_id=replica.prepared.push_id, commit=commit),
            deadline,
        )
        for replica in group
        if replica.prepared is not None and replica.prepared.prepared
    }
    outcome = {}
    for target, call in calls.items():
        try:
            outcome[target] = call.result()
        except grpc.RpcError as exc:
            outcome[target] = ScoringError.from_rpc_error(exc)
    return outcome


def _abort(group: list[_Replica], deadline: float) -> None:
    for replica in group:
        if replica.future is not None and not replica.future.done():
            replica.future.cancel()  # the replica drops what it staged
    _finish(group, False, deadline)  # best effort: a lost one drops it after its timeout


def _commit(group: list[_Replica], deadline: float, start: float) -> PushResult:
    outcome = _finish(group, True, deadline)
    seconds = time.perf_counter() - start
    failed = {t: r for t, r in outcome.items() if isinstance(r, ScoringError)}
    if failed:
        target, error = next(iter(failed.items()))
        done = [t for t, r in outcome.items() if not isinstance(r, ScoringError)]
        raise ScoringError(
            error.code,
            f"weight push: replica {target} failed to commit: {error.details}; every "
            f"replica had prepared, these committed: {done or 'none'}",
        )
    results = [PushResult.from_proto(outcome[r.target], seconds) for r in group]
    return dataclasses.replace(results[0], replicas=results)

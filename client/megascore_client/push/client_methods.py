"""The push methods of the clients (``push_weights``, ``push_adapter``): :class:`PushMethods`
of :class:`~megascore_client.client.ScoringClient`, :class:`AsyncPushMethods` of
``AsyncScoringClient``, over what both share (:class:`PushBase`: a push's requests, the
packing lookup's answer). Mixins of a :class:`~megascore_client.client_base.ClientBase`,
which holds their state (``_delta_bases``, ``_packs``)."""

from __future__ import annotations

import asyncio
import threading
import time

from megascore.v1 import scoring_pb2 as pb
from megascore_client.errors import ScoringError
from megascore_client.push.adapter import adapter_push
from megascore_client.push.plan import PushCall, push_steps, run_steps, run_steps_async
from megascore_client.push.replicas import (
    LOOKUP_S,
    push_to_replicas,
    tensor_chunks_answer,
    tensor_chunks_lookup,
)
from megascore_client.push.requests import (
    PUSH_TIMEOUT_S,
    PushResult,
    chunk_size,
    finish,
    push_requests,
    weights_version_argument,
)

__all__ = ["AsyncPushMethods", "PushBase", "PushMethods"]


class PushBase:
    """What the sync and the asyncio push methods share (on a ``ClientBase``)."""

    def _push_requests(
        self,
        named_tensors,
        timeout: float | None,
        *,
        chunk_bytes: int | None = None,
        weights_version: str = "",
        version: str | None = None,
        names: str = "hf",
        partial: bool = False,
        progress=None,
        prepare_timeout_s: float | None = None,
        base=None,
        kept=None,
        begin: dict | None = None,
        pack: bool = False,
    ):
        """A ``push_weights`` call's requests (encoded as they are consumed), the counters
        they fill and the deadline (arguments: those of ``push_weights``; ``pack``: small
        tensors several to a message, see :meth:`_learned_packing`)."""
        counters: dict = {}
        requests = push_requests(
            named_tensors,
            names=names,
            weights_version=weights_version_argument(weights_version, version),
            partial=partial,
            chunk_bytes=chunk_size(chunk_bytes, self.message_limit),
            progress=progress,
            counters=counters,
            prepare_timeout_s=prepare_timeout_s,
            base=base,
            kept=kept,
            begin=begin,
            pack=pack,
        )
        deadline = time.monotonic() + (PUSH_TIMEOUT_S if timeout is None else timeout)
        return requests, counters, deadline

    def _lookup_deadline(self, timeout: float | None) -> float:
        """The deadline of the packing lookup before a push (:data:`LOOKUP_S` at most)."""
        limit = LOOKUP_S if timeout is None else min(timeout, LOOKUP_S)
        return time.monotonic() + limit

    def _learned_packing(self, targets: list[str], answer: bool | None) -> bool:
        """Whether a push to ``targets`` packs small tensors several to a message
        (``UpdateWeightsRequest.chunks``): only when every replica's ModelInfo says
        ``accepts_tensor_chunks`` (an older server refuses such a message). ``answer``:
        the lookup's (:func:`~megascore_client.push.replicas.tensor_chunks_answer`),
        remembered for the client's later pushes unless None (a replica not reached)."""
        if answer is not None:
            self._packs[tuple(targets)] = answer
        return bool(answer)


class PushMethods(PushBase):
    """``push_weights`` and ``push_adapter`` of :class:`~megascore_client.client.ScoringClient`."""

    def push_weights(
        self,
        named_tensors,
        *,
        weights_version: str = "",
        names: str = "hf",
        partial: bool = False,
        chunk_bytes: int | None = None,
        progress=None,
        timeout: float | None = None,
        version: str | None = None,
        replicas=None,
        prepare_timeout_s: float = 60.0,
        delta: bool = False,
        weight_set: str = "",
        adapter: str = "",
        adapter_config: str = "",
    ) -> PushResult:
        """Streams new weights into the server (``UpdateWeights``), then swaps them in.

        To several replicas (a target of several addresses: ``ipv4:a,b``, a ``dns:///``
        name resolving to several; or ``replicas``), all or none: every replica stages
        the push, and only when all did is it committed on each
        (:mod:`megascore_client.push.replicas`).

        Args:
            named_tensors: iterable of ``(name, tensor)``: numpy arrays, torch tensors
                (bf16 kept) or :class:`~megascore_client.push.requests.RawTensor`, full (unsharded)
                float tensors; consumed once, lazily (a generator keeps one in memory).
            weights_version: label of the new weights ("" = the server generates one),
                the same keyword as ``load_weights``.
            names: "hf" (transformers names) or "megatron" (see docs/client.md).
            partial: update only the tensors sent (otherwise all must be sent).
            chunk_bytes: tensor bytes per message (default 8 MiB, under the message limit).
            progress: ``progress(bytes_sent, tensor_name)`` after each chunk.
            timeout: deadline of the whole push in seconds (default 1800).
            version: deprecated name of ``weights_version`` (a ``DeprecationWarning``).
            replicas: targets to push to, all or none (default: the replicas of the
                client's target; one replica: a plain one-phase push).
            prepare_timeout_s: several replicas: how long each holds the staged push
                for its commit before dropping it (a client that died in between).
            delta: send only what changed since this client's last ``delta=True`` push
                to the same replicas (whole tensors whose bytes changed; (index, value)
                patches of tensors with few changed elements). The first such push is
                in full and makes the replicas keep a host copy of the weights (and this
                client one too); a replica that does not hold that base any more
                (another push or load since) refuses the delta and the push is redone
                in full. ``named_tensors`` is listed once (references, no copy).
            weight_set: the weight set the push changes ("": the default).
            adapter, adapter_config: a LoRA adapter's push (:meth:`push_adapter`).

        Returns:
            A :class:`~megascore_client.push.requests.PushResult` (version, bytes, seconds, bytes/s;
            of the first replica when several, ``replicas`` holding each one's).

        Raises:
            InvalidInputError: a tensor that cannot be pushed (the server keeps its weights).
            ScoringError: refused by the server, old weights kept: INVALID_ARGUMENT (a
                name / shape / dtype the model does not have, tensors missing), ABORTED
                (another push in progress), ... Never re-sent.
        """
        steps = push_steps(
            self._delta_bases, self.target, named_tensors,
            weights_version=weights_version, version=version, names=names, partial=partial,
            chunk_bytes=chunk_bytes, progress=progress, replicas=replicas,
            prepare_timeout_s=prepare_timeout_s, delta=delta,
            begin=dict(weight_set=weight_set, adapter=adapter, adapter_config=adapter_config),
        )  # fmt: skip
        return run_steps(steps, lambda call: self._push(call, timeout))

    def push_adapter(self, name: str, state_dict, config=None, **arguments) -> PushResult:
        """Pushes LoRA adapter ``name`` whole (``get_peft_model_state_dict(model)``, its
        ``LoraConfig``: :func:`megascore_client.push.adapter.adapter_push`); ``arguments``
        as :meth:`push_weights` (``weight_set`` of a new adapter, replicas all or none)."""
        return self.push_weights(**adapter_push(name, state_dict, config), **arguments)

    def _push(self, call: PushCall, timeout: float | None) -> PushResult:
        """One push of ``push_weights`` (to ``call.targets``, all or none when several)."""
        requests, counters, deadline = self._push_requests(
            call.named_tensors, timeout, pack=self._packing(call, timeout), **call.options
        )
        if call.several:
            return push_to_replicas(self.settings, call.targets, requests, counters, deadline)
        start = time.perf_counter()
        future = self.transport.start(self.transport.stub.UpdateWeights, requests, deadline)
        try:
            response = self.transport.result(future)
        except ScoringError as exc:
            response = exc
        return finish(response, counters, start)

    def _packing(self, call: PushCall, timeout: float | None) -> bool:
        """Whether ``call`` packs small tensors (asks its replicas once: ``_learned_packing``)."""
        if tuple(call.targets) in self._packs:
            return self._packs[tuple(call.targets)]
        deadline = self._lookup_deadline(timeout)
        if call.several:
            answer = tensor_chunks_lookup(self.settings, call.targets, deadline)
        else:
            try:
                info = self.transport.call(
                    self.transport.stub.GetModelInfo, pb.GetModelInfoRequest(), deadline
                )
                answer = tensor_chunks_answer(info, None)
            except ScoringError as exc:
                answer = tensor_chunks_answer(None, exc)
        return self._learned_packing(call.targets, answer)


class AsyncPushMethods(PushBase):
    """``push_weights`` and ``push_adapter`` of ``AsyncScoringClient`` (awaitable)."""

    async def push_weights(
        self, named_tensors, *, timeout: float | None = None, **arguments
    ) -> PushResult:
        """Streams new weights into the server and swaps them in; arguments (those of
        ``ScoringClient.push_weights``: to several replicas all or none, deltas), result
        and errors as there. One replica: the tensors are encoded on the event loop;
        several: the push runs in a worker thread, and cancelling the call aborts it on
        every replica (unless the commits began)."""
        steps = push_steps(self._delta_bases, self.target, named_tensors, **arguments)
        return await run_steps_async(steps, lambda call: self._push(call, timeout))

    async def push_adapter(self, name: str, state_dict, config=None, **arguments) -> PushResult:
        """Pushes LoRA adapter ``name`` whole (see ``ScoringClient.push_adapter``)."""
        return await self.push_weights(**adapter_push(name, state_dict, config), **arguments)

    async def _push(self, call: PushCall, timeout: float | None) -> PushResult:
        """One push of ``push_weights`` (to ``call.targets``, all or none when several)."""
        pack = await self._packing(call, timeout)
        requests, counters, deadline = self._push_requests(
            call.named_tensors, timeout, pack=pack, **call.options
        )
        if call.several:
            cancelled = threading.Event()
            try:
                return await asyncio.to_thread(
                    push_to_replicas,
                    self.settings,
                    call.targets,
                    requests,
                    counters,
                    deadline,
                    cancelled,
                )
            except asyncio.CancelledError:
                cancelled.set()  # the thread aborts the push on every replica
                raise
        start = time.perf_counter()
        try:
            response = await self.transport.call(
                self.transport.stub.UpdateWeights, requests, deadline
            )
        except ScoringError as exc:
            response = exc
        return finish(response, counters, start)

    async def _packing(self, call: PushCall, timeout: float | None) -> bool:
        """Whether ``call`` packs small tensors (see ``ScoringClient._packing``)."""
        if tuple(call.targets) in self._packs:
            return self._packs[tuple(call.targets)]
        deadline = self._lookup_deadline(timeout)
        if call.several:
            answer = await asyncio.to_thread(
                tensor_chunks_lookup, self.settings, call.targets, deadline
            )
        else:
            try:
                info = await self.transport.call(
                    self.transport.stub.GetModelInfo, pb.GetModelInfoRequest(), deadline
                )
                answer = tensor_chunks_answer(info, None)
            except ScoringError as exc:
                answer = tensor_chunks_answer(None, exc)
        return self._learned_packing(call.targets, answer)

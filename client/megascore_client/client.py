"""Synchronous client: :class:`ScoringClient`, and :class:`ClientBase`, what it shares
with the asyncio client (configuration, limits, the re-send schedule, the trainer
layouts)."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import grpc

from megascore.v1 import scoring_pb2 as pb
from megascore_client import health as health_codec
from megascore_client.channel import DEFAULT_MAX_MESSAGE_BYTES, ChannelSettings, TlsConfig
from megascore_client.errors import ScoringError, closed_error
from megascore_client.push.plan import PushCall, push_steps, run_steps
from megascore_client.push.replicas import push_to_replicas
from megascore_client.push.requests import (
    PUSH_TIMEOUT_S,
    PushResult,
    chunk_size,
    finish,
    push_requests,
    weights_version_argument,
)
from megascore_client.results import HealthStatus, LoadWeightsResult, ModelInfo, ScoreResult
from megascore_client.splitting import Part, decode_part, merge, prepare
from megascore_client.stream import ScoreStream
from megascore_client.text import TextMethods
from megascore_client.trainer_layouts import (
    PaddedLayout,
    group_sequences,
    nemo_rl_layout,
    verl_layout,
)
from megascore_client.transport import SyncTransport
from megascore_client.waiting import ServerWait, check_wait, pinned_version

logger = logging.getLogger(__name__)

__all__ = ["ClientBase", "ScoringClient"]

UNRESOLVED = object()
LOAD_WEIGHTS_TIMEOUT_S = 600.0
LOAD_PROGRESS_INTERVAL_S = 1.0
LoadProgress = Callable[[float], None]
"""``progress(elapsed_s)``, called about once a second while a ``load_weights`` runs."""
WaitCallback = Callable[[float, ScoringError | None], None]
"""``on_wait(waited_s, error)``: a request waits for the server (see ``on_wait``)."""


def _adapter_arguments(
    temperature, request_id, timeout, rollout_logprobs, mismatch_ratio_cap, weights_version
) -> dict:
    """The ``score`` arguments a trainer adapter (``score_padded`` / ``score_responses``)
    passes on, by name."""
    return dict(
        temperature=temperature,
        request_id=request_id,
        timeout=timeout,
        rollout_logprobs=rollout_logprobs,
        mismatch_ratio_cap=mismatch_ratio_cap,
        weights_version=weights_version,
    )


class ClientBase:
    """Configuration shared by :class:`ScoringClient` and ``AsyncScoringClient``.

    The constructor's arguments are documented on ``__init__`` (``help(ScoringClient)``
    shows them).
    """

    def __init__(
        self,
        target: str,
        *,
        tls: TlsConfig | bool | None = None,
        token: str | None = None,
        timeout: float | None = 60.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        retries=True,
        load_balancing: str | None = None,
        keepalive_time_s: float | None = 300.0,
        max_request_tokens: int | str | None = "auto",
        max_concurrency: int = 4,
        wait_for_server_s: float = 0.0,
        on_wait: WaitCallback | None = None,
    ):
        """Configures the client and opens its channel.

        Args:
            target: gRPC target: ``"host:port"``, ``"dns:///name:port"`` (with
                ``load_balancing="round_robin"`` to spread calls over every address),
                ``"ipv4:10.0.0.1:50051,10.0.0.2:50051"``, ``"unix:/path"``.
            tls: None (plaintext), True (TLS with the system roots) or a
                :class:`TlsConfig` (custom CA, mutual TLS, server-name override).
            token: bearer token sent as ``authorization: Bearer <token>`` metadata.
            timeout: default deadline in seconds of each RPC (None = no deadline).
                Retries, and the re-sends of ``wait_for_server_s``, happen within it.
            max_message_bytes: send and receive limit of the channel; larger batches are
                split into several requests. With ``max_request_tokens="auto"``, the
                server's own limit (``ModelInfo.max_message_bytes``) is looked up too, and
                batches are split under the smaller of the two.
            retries: retry policy for UNAVAILABLE only: a :class:`RetryPolicy`, True
                (default policy: 5 attempts, backoff 0.2 s x2 up to 5 s), an int number
                of retries (0-4), or None to disable.
            load_balancing: None (gRPC default, pick_first), "pick_first" or
                "round_robin" (set in the service config).
            keepalive_time_s: HTTP/2 keepalive ping interval while calls are active
                (None = off). gRPC servers by default punish pings more frequent than
                every 300 s on a call that sends no data (GOAWAY "too_many_pings"), so
                go lower only when the server allows it
                (``grpc.http2.min_recv_ping_interval_without_data_ms``).
            max_request_tokens: tokens per request before a batch is split: an int,
                None (no token limit), or "auto" (ask the server once through
                GetModelInfo, on the first ``score``, for its token limit, its message
                size limit and whether it takes groups: consecutive sequences sharing a
                prompt then send it once, ``ScoreRequest.groups``; with another value
                every sequence is sent whole).
            max_concurrency: parts of one split batch in flight at once.
            wait_for_server_s: how long to ride out a server that is down or restarting
                (0 = off: UNAVAILABLE is raised after gRPC's own retries). When > 0, a
                Score request (each part of a split batch) or a GetModelInfo that still
                ends in UNAVAILABLE is re-sent, with a backoff of 0.5 s doubling up to
                5 s (+-20 % jitter), until the server answers or this many seconds have
                passed since its first UNAVAILABLE; then that ScoringError (UNAVAILABLE,
                details saying how long it waited) is raised. Other codes are raised at
                once. The re-sends stay inside the request's ``timeout``, which must
                exceed ``wait_for_server_s`` (or be None). ``load_weights``,
                ``health`` and streams are never re-sent (see ``docs/client.md``).
            on_wait: ``on_wait(waited_s, error)`` while a request waits for the server:
                before each re-send with the UNAVAILABLE that caused it, and once with
                ``error=None`` when the server answered. Default: the ``megascore_client``
                logger says so (a warning when the wait starts, info when it ends).
        """
        if max_request_tokens != "auto" and not (
            max_request_tokens is None or int(max_request_tokens) > 0
        ):
            raise ValueError("max_request_tokens must be > 0, None or 'auto'")
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        self.settings = ChannelSettings.build(
            target,
            tls=tls,
            retries=retries,
            token=token,
            max_message_bytes=max_message_bytes,
            load_balancing=load_balancing,
            keepalive_time_s=keepalive_time_s,
        )
        self.timeout = timeout
        self.wait_for_server_s = check_wait(wait_for_server_s, timeout)
        self.max_concurrency = max_concurrency
        self.on_wait = on_wait
        self._token_limit = UNRESOLVED if max_request_tokens == "auto" else max_request_tokens
        self._delta_bases: dict[tuple[str, ...], tuple[str, dict]] = {}  # targets -> kept
        self._server_message_bytes = 0  # ModelInfo.max_message_bytes, with "auto" (0 = unknown)
        self._server_groups = False  # ModelInfo.accepts_sequence_groups, with "auto"
        self._open()

    def _open(self) -> None:
        """Opens the transport (each client kind its own)."""
        raise NotImplementedError

    @property
    def target(self) -> str:
        return self.settings.target

    def _deadline(self, timeout: float | None) -> float | None:
        """The ``time.monotonic()`` deadline of a request (None = none) from its
        ``timeout`` argument (None = the client's default)."""
        timeout = self.timeout if timeout is None else timeout
        return None if timeout is None else time.monotonic() + timeout

    @property
    def message_limit(self) -> int:
        """The message size batches are split under: ``max_message_bytes``, or the
        server's smaller limit once known (``ModelInfo.max_message_bytes``, looked up
        with ``max_request_tokens="auto"`` on the first ``score``)."""
        own = self.settings.max_message_bytes
        server = self._server_message_bytes
        return min(own, server) if server > 0 else own

    def _resend_delay(self, error: ScoringError, wait: bool, deadline, schedule, request=None):
        """After a failed attempt: ``(schedule, delay)`` before re-sending the request;
        raises ``error`` when it is not to be re-sent (``wait`` False, option off, not
        UNAVAILABLE, and not a pinned ``request`` refused by a replica serving another
        weights version) and the schedule's final error when the wait is over."""
        if error.code is grpc.StatusCode.FAILED_PRECONDITION and pinned_version(request):
            schedule = schedule or ServerWait(self.wait_for_server_s, deadline)
            delay = schedule.next_pin_delay()
            if delay is None:
                raise error
            return schedule, delay
        if not (wait and self.wait_for_server_s > 0 and error.retryable):
            raise error
        schedule = schedule or ServerWait(self.wait_for_server_s, deadline)
        delay = schedule.next_delay()
        if delay is None:
            raise schedule.gave_up(error)
        self._tell_wait(schedule, error)
        return schedule, delay

    def _tell_wait(self, schedule: ServerWait | None, error: ScoringError | None) -> None:
        """Says that a request waits for the server (``error``: the UNAVAILABLE before a
        re-send) or got its answer after waiting (``error`` None): ``on_wait``, else a
        log line."""
        if schedule is None or not schedule.resends:
            return
        waited = schedule.waited()
        if self.on_wait is not None:
            self.on_wait(waited, error)
        elif error is None:
            logger.info("the server at %s answered after %.1f s", self.target, waited)
        elif schedule.resends == 1:
            logger.warning(
                "waiting up to %g s for the server at %s: %s",
                self.wait_for_server_s,
                self.target,
                error,
            )

    def score_padded(
        self,
        input_ids,
        input_lengths,
        *,
        temperature: float = 1.0,
        request_id: str | None = None,
        timeout: float | None = None,
        rollout_logprobs: object = None,
        mismatch_ratio_cap: float | None = None,
        weights_version: str = "",
    ):
        """Logprobs of a NeMo-RL batch (awaitable on ``AsyncScoringClient``): right-padded
        ``input_ids [B, S]`` and ``input_lengths [B]`` (layout in
        :mod:`megascore_client.trainer_layouts`).

        Args:
            input_ids: int ``[B, S]`` (numpy, torch or array-like).
            input_lengths: int ``[B]``, each in ``[0, S]``.
            temperature, request_id, timeout, weights_version: as for :meth:`score`.
            rollout_logprobs: ``[B, S]`` (the layout of the result), the rollout
                engine's logprobs; ``mismatch_ratio_cap``: see Returns.

        Returns:
            float32 ``[B, S]``: entry ``[b, t]`` is ``log p(x_t | x_<t)`` of row b for
            ``1 <= t < input_lengths[b]``, 0.0 at t = 0 and past the length; a torch
            tensor on the device of ``input_ids`` when that is a torch tensor. With
            ``rollout_logprobs``: ``(logprobs, mismatch)``, ``mismatch`` the statistics
            of ``ScoreResult.mismatch_stats`` per row (float64 ``[B]``).
        """
        layout = nemo_rl_layout(input_ids, input_lengths)
        arguments = _adapter_arguments(
            temperature, request_id, timeout, rollout_logprobs, mismatch_ratio_cap, weights_version
        )
        return self._score_layout(layout, arguments)

    def score_responses(
        self,
        input_ids,
        attention_mask,
        responses,
        *,
        temperature: float = 1.0,
        request_id: str | None = None,
        timeout: float | None = None,
        rollout_logprobs: object = None,
        mismatch_ratio_cap: float | None = None,
        weights_version: str = "",
    ):
        """Response logprobs of a verl batch (awaitable on ``AsyncScoringClient``):
        ``input_ids [B, P+R]`` (left-padded prompts, then right-padded responses),
        ``attention_mask [B, P+R]``, ``responses [B, R]`` (layout in
        :mod:`megascore_client.trainer_layouts`).

        Args:
            input_ids, attention_mask, responses: as verl's ``compute_log_prob`` takes them.
            temperature, request_id, timeout, weights_version: as for :meth:`score`.
            rollout_logprobs: ``[B, R]`` (verl's ``old_log_probs`` layout), the rollout
                engine's logprobs; ``mismatch_ratio_cap``: see Returns.

        Returns:
            float32 ``[B, R]``: entry ``[b, j]`` is the logprob of ``responses[b, j]``
            given the real tokens before it, 0.0 on response padding (torch in, torch out).
            With ``rollout_logprobs``: ``(logprobs, mismatch)`` as for
            :meth:`score_padded`, over the response tokens.
        """
        layout = verl_layout(input_ids, attention_mask, responses)
        arguments = _adapter_arguments(
            temperature, request_id, timeout, rollout_logprobs, mismatch_ratio_cap, weights_version
        )
        return self._score_layout(layout, arguments)

    def score_groups(self, prompts, continuations, **options):
        """Scores groups (awaitable on ``AsyncScoringClient``): each prompt followed by
        each of its continuations (GRPO's n responses to one prompt, agentic turns after
        one history).

        The sequences ``prompts[g] + continuations[g][j]`` are scored in this order with
        the loss mask on the continuations; each prompt travels once per request
        (``ScoreRequest.groups``, as for any consecutive sequences sharing a prompt, see
        ``max_request_tokens``) and the server computes a prompt that its sequences
        share once when they land in one engine step (docs/engine.md, "Shared
        prefixes").

        Args:
            prompts: ``G`` token sequences.
            continuations: ``G`` lists of token sequences (at least one per prompt).
            **options: as for :meth:`score` (``top_k``, ``temperature``, ``losses``,
                ...); not ``loss_mask`` (the continuations').

        Returns:
            The :class:`ScoreResult` of the ``sum(len(c) for c in continuations)``
            sequences, group after group; the losses are the continuations' (e.g. the NLL
            of each response), entry ``t >= len(prompts[g])`` of a sequence's logprobs is
            its continuation's token ``t - len(prompts[g])``.
        """
        sequences, masks = group_sequences(prompts, continuations)
        return self.score(sequences, loss_mask=masks, **options)

    def prepare_call(self, sequences, arguments: dict, limit) -> tuple[list[Part], str]:
        """The requests of one ``score`` / ``submit`` call (:func:`splitting.prepare`)."""
        return prepare(
            sequences,
            arguments,
            max_message_bytes=self.message_limit,
            max_request_tokens=limit,
            groups=self._server_groups,
        )

    def _failed_probe(self, exc: ScoringError) -> HealthStatus:
        """A health probe of ``wait_until_serving`` that failed: not serving, the error as
        its status; raises CANCELLED when the client was closed before or during it."""
        if self.transport.closed:
            raise closed_error() from None
        return HealthStatus(serving=False, status=str(exc))

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
    ):
        """A ``push_weights`` call's requests (encoded as they are consumed), the counters
        they fill and the deadline (arguments: those of ``push_weights``)."""
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
        )
        deadline = time.monotonic() + (PUSH_TIMEOUT_S if timeout is None else timeout)
        return requests, counters, deadline

    def _learn_limits(self, info: ModelInfo) -> ModelInfo:
        """Resolves ``max_request_tokens="auto"`` from a GetModelInfo answer: the server's
        token limit and message size limit (0 = not reported: the client's applies), and
        whether it takes groups (shared prompts sent once)."""
        if self._token_limit is UNRESOLVED:
            self._server_message_bytes = max(int(info.max_message_bytes), 0)
            self._server_groups = bool(info.accepts_sequence_groups)
            self._token_limit = info.max_request_tokens or None
        return info

    def _lookup_failed(self, error: ScoringError) -> None:
        """The "auto" lookup failed: a server without GetModelInfo has no limits."""
        if error.code is not grpc.StatusCode.UNIMPLEMENTED:
            raise error
        self._token_limit = None

    def _not_serving(self, timeout: float, last: str) -> ScoringError:
        return ScoringError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"{self.target} not SERVING after {timeout:.1f}s (last: {last})",
        )


def finish_score(results: list[ScoreResult], request_id: str, start: float) -> ScoreResult:
    """The call's result: its parts merged, with the client's wall time."""
    result = merge(results, request_id)
    result.timings.client_ms = (time.perf_counter() - start) * 1e3
    return result


class ScoringClient(TextMethods, ClientBase):
    """Blocking megascore client. Thread-safe; use as a context manager.

    The constructor takes ``target`` and the keyword arguments of
    :meth:`ClientBase.__init__`. ``transport`` is the
    :class:`~megascore_client.transport.SyncTransport` every call and stream goes through.

    Example:
        >>> with ScoringClient("127.0.0.1:50051") as client:
        ...     result = client.score([[1, 2, 3], [4, 5]], top_k=2)
        ...     result.logprobs[0]  # float32 [3], entry 0 is 0.0
    """

    def _open(self) -> None:
        self.transport = SyncTransport(self.settings)
        self._lock = threading.Lock()

    def __enter__(self) -> ScoringClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled (CANCELLED), later calls
        and requests waiting for the server raise CANCELLED."""
        self.transport.close()

    def _unary(self, method, request, deadline, *, wait: bool = False, error=None):
        """Sends ``request`` (after ``error``, the failure of an attempt already made,
        per the re-send schedule); with ``wait``, re-sent on UNAVAILABLE per
        ``wait_for_server_s``."""
        schedule = None
        while True:
            if error is not None:
                schedule, delay = self._resend_delay(error, wait, deadline, schedule, request)
                if self.transport.sleep(delay):
                    raise closed_error()
            try:
                response = self.transport.call(method, request, deadline)
            except ScoringError as exc:
                error = exc
            else:
                self._tell_wait(schedule, None)
                return response

    def request_token_limit(self) -> int | None:
        """The per-request token limit used for splitting (resolves "auto" once, which
        also learns the server's message size limit, see :attr:`message_limit`)."""
        with self._lock:
            if self._token_limit is UNRESOLVED:
                try:
                    self.model_info()
                except ScoringError as exc:
                    self._lookup_failed(exc)
            return self._token_limit

    def score(
        self,
        sequences,
        *,
        loss_mask=None,
        lengths=None,
        top_k: int = 0,
        temperature: float = 1.0,
        losses=("nll",),
        metrics=(),
        return_logprobs: bool = True,
        return_routing: bool = False,
        routing=None,
        return_entropy: bool = False,
        target_ids=None,
        rollout_logprobs=None,
        mismatch_ratio_cap: float | None = None,
        return_importance_weights: bool = False,
        weights_version: str = "",
        logprob_positions: str = "all",
        return_token_ranks: bool = False,
        return_next_token: bool = False,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> ScoreResult:
        """Scores a batch of token sequences.

        Args:
            sequences: a list of sequences (lists of ints, 1-D numpy arrays or any
                array-like such as torch tensors) or a 2-D array ``[B, W]``.
            loss_mask: optional 0/1 mask, same structure; entry 0 of each sequence
                never counts. Applies to the losses, not to ``logprobs``.
            lengths: with a 2-D ``sequences``, the length of each row (right padding
                is dropped).
            top_k: number of most likely alternatives per position (0 = none).
            temperature: softmax temperature (> 0).
            losses: per-sequence losses to compute ("nll" = summed masked NLL).
            metrics: metric groups to return: any of "moe", "mtp".
            return_logprobs: whether to return per-token logprobs.
            return_routing: whether to return the MoE routing (``ScoreResult.routing``:
                per sequence, per token, the experts of every MoE layer). MoE models only.
            routing: a MoE routing to replay instead of routing, one integer
                ``[L_i, num_moe_layers, topk]`` array per sequence (a
                ``ScoreResult.routing``): the forward uses these experts (Megatron's
                RouterReplay), e.g. the rollout engine's routes. MoE models only.
            return_entropy: return the per-token entropy (``ScoreResult.entropy``).
            target_ids: ids whose logprobs to return at every position, one integer
                ``[L_i, K]`` array per sequence (``ScoreResult.target_logprobs``;
                ``K <= ModelInfo.max_target_ids``; row 0 ignored).
            rollout_logprobs: the rollout engine's logprobs of the same tokens, one
                ``[L_i]`` array per sequence (entry 0 ignored): ``ScoreResult.mismatch``
                holds per-sequence train/inference mismatch statistics
                (docs/client.md, "Train/inference mismatch").
            mismatch_ratio_cap: the importance-ratio cap ``c`` of those statistics
                (default 2.0; > 1).
            return_importance_weights: with ``rollout_logprobs``, return the per-token
                truncated importance weights ``min(exp(scored - rollout), c)``.
            weights_version: score with exactly these weights (a ``weights_version``
                of a push, a load or a result; "" = whatever is served). A replica
                serving another version refuses the request (FAILED_PRECONDITION naming
                both); it is re-sent up to 3 times within ``timeout`` (0.1, 0.2, 0.4 s
                apart; the next replica under ``round_robin``), then the error is raised.
            logprob_positions: "all" (default) or "masked": the per-token outputs of the
                output head (logprobs, top-k, entropy, target logprobs, importance
                weights, token ranks) only where ``loss_mask`` is 1 (entry 0 of each
                sequence excluded), their fill (0.0, top-k ids -1) elsewhere; the server
                then runs the output head and log-softmax only at those positions.
                Losses, routing, the mismatch statistics and the next token do not
                change.
            return_token_ranks: return the rank of every token among the whole
                vocabulary at its position (``ScoreResult.token_ranks``; 1 = the most
                likely, ties count against the token, as vLLM's ``rank``; entry 0 is 0).
            return_next_token: return the prediction after the last token of each
                sequence: the ``max(1, top_k)`` most likely next tokens and their
                logprobs (``ScoreResult.next_token_ids`` / ``next_token_logprobs``,
                ``[B, max(1, top_k)]``; column 0 is the greedy next token).
            request_id: id echoed by the server and in its logs (generated if None).
            timeout: deadline of each request in seconds (default: the client's).

        Returns:
            A :class:`ScoreResult` with one entry per sequence, in input order.

        Raises:
            InvalidInputError: the input is rejected before sending.
            ScoringError: the call failed (``code`` holds the gRPC status code;
                ``sequence_index`` the sequence an INVALID_ARGUMENT names).
        """
        start = time.perf_counter()
        arguments = dict(
            loss_mask=loss_mask,
            lengths=lengths,
            top_k=top_k,
            temperature=temperature,
            losses=losses,
            metrics=metrics,
            return_logprobs=return_logprobs,
            return_routing=return_routing,
            routing=routing,
            return_entropy=return_entropy,
            target_ids=target_ids,
            rollout_logprobs=rollout_logprobs,
            mismatch_ratio_cap=mismatch_ratio_cap,
            return_importance_weights=return_importance_weights,
            weights_version=weights_version,
            logprob_positions=logprob_positions,
            return_token_ranks=return_token_ranks,
            return_next_token=return_next_token,
            request_id=request_id,
        )
        parts, rid = self.prepare_call(sequences, arguments, self.request_token_limit())
        return finish_score(self._send(parts, timeout), rid, start)

    def _send(self, parts: list[Part], timeout: float | None) -> list[ScoreResult]:
        score = self.transport.stub.Score
        results: list[ScoreResult | None] = [None] * len(parts)
        inflight: collections.deque = collections.deque()

        def collect():
            index, future, deadline = inflight.popleft()
            part = parts[index]
            with part.located():
                try:
                    response = self.transport.result(future)
                except ScoringError as exc:
                    # UNAVAILABLE + wait_for_server_s: re-sent here, the others stay in flight
                    response = self._unary(score, part.request, deadline, wait=True, error=exc)
                results[index] = decode_part(response, part)

        try:
            for index, part in enumerate(parts):
                if len(inflight) >= self.max_concurrency:
                    collect()
                deadline = self._deadline(timeout)
                future = self.transport.start(score, part.request, deadline)
                inflight.append((index, future, deadline))
            while inflight:
                collect()
        finally:
            for _, future, _ in inflight:
                future.cancel()
        return results

    def _score_layout(self, layout: PaddedLayout, kwargs: dict):
        arguments = layout.score_arguments(kwargs)
        scored = self.score(layout.sequences, **arguments) if layout.sequences else None
        return layout.answer(scored, kwargs)

    def stream(self, *, timeout: float | None = None) -> ScoreStream:
        """Opens a ScoreStream bidi call for rollout loops (see :class:`ScoreStream`).

        Args:
            timeout: deadline of the whole stream (default: none).

        Raises:
            ScoringError: CANCELLED ("the client is closed") on a closed client.
        """
        return ScoreStream(self, timeout=timeout)

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """Describes the served model and its limits (waits like ``score``; resolves
        ``max_request_tokens="auto"`` when not done yet)."""
        msg = self._unary(
            self.transport.stub.GetModelInfo,
            pb.GetModelInfoRequest(),
            self._deadline(timeout),
            wait=True,
        )
        return self._learn_limits(ModelInfo.from_proto(msg))

    def load_weights(
        self,
        model: str,
        weights_version: str = "",
        *,
        timeout: float | None = None,
        progress: LoadProgress | None = None,
    ) -> LoadWeightsResult:
        """Asks the server to load new weights ("hf:DIR" / "megatron:DIR" on the server).

        Args:
            model: checkpoint to load.
            weights_version: optional label (the server derives one when empty).
            timeout: deadline in seconds (default: 600).
            progress: ``progress(elapsed_s)`` about once a second while the server loads
                (the server reports no fraction; the CLI draws it as an elapsed-time line).

        Never re-sent by ``wait_for_server_s``: a reload is heavy and changes the
        server's state (an UNAVAILABLE may come after it started), and a restarted
        server serves the weights it was started with, not the last ones loaded; after
        an UNAVAILABLE the caller decides (``wait_until_serving``, then load again).
        """
        request = pb.LoadWeightsRequest(model=model, weights_version=weights_version)
        deadline = self._deadline(LOAD_WEIGHTS_TIMEOUT_S if timeout is None else timeout)
        future = self.transport.start(self.transport.stub.LoadWeights, request, deadline)
        if progress is not None:
            done = threading.Event()
            future.add_done_callback(lambda _: done.set())
            start = time.monotonic()
            try:
                while not done.wait(LOAD_PROGRESS_INTERVAL_S):
                    progress(time.monotonic() - start)
            except BaseException:  # the callback failed or the caller was interrupted
                future.cancel()
                raise
        return LoadWeightsResult.from_proto(self.transport.result(future))

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
        )  # fmt: skip
        return run_steps(steps, lambda call: self._push(call, timeout))

    def _push(self, call: PushCall, timeout: float | None) -> PushResult:
        """One push of ``push_weights`` (to ``call.targets``, all or none when several)."""
        requests, counters, deadline = self._push_requests(
            call.named_tensors, timeout, **call.options
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

    def health(self, service: str = "", *, timeout: float | None = None) -> HealthStatus:
        """Runs the ``grpc.health.v1`` check ("" = the whole server).

        Returns:
            The status; SERVICE_UNKNOWN when the server does not know ``service``.

        Raises:
            ScoringError: the server cannot be reached (UNAVAILABLE) or similar.
        """
        request, deadline = health_codec.encode_request(service), self._deadline(timeout)
        try:
            data = self.transport.call(self.transport.health_check, request, deadline)
        except ScoringError as exc:
            return health_codec.status_after(exc)
        return health_codec.decode_response(data)

    def wait_until_serving(self, timeout: float = 60.0, interval: float = 0.5) -> HealthStatus:
        """Polls ``health()`` until SERVING.

        Raises:
            ScoringError: DEADLINE_EXCEEDED with the last status or error after
                ``timeout``; CANCELLED ("the client is closed") at once when the
                client is or gets closed.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                status = self.health(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except ScoringError as exc:
                status = self._failed_probe(exc)
            if status.serving:
                return status
            if time.monotonic() + interval > deadline:
                raise self._not_serving(timeout, status.status)
            if self.transport.sleep(interval):
                raise closed_error()

"""What the synchronous and the asyncio clients share: :class:`ClientBase` (configuration,
limits, the re-send schedule, the trainer layouts) and :func:`finish_score`; their push
methods share :class:`~megascore_client.push.client_methods.PushBase`."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import grpc

from megascore_client.channel import DEFAULT_MAX_MESSAGE_BYTES, ChannelSettings, TlsConfig
from megascore_client.errors import ScoringError, closed_error
from megascore_client.push.replicas import replica_targets
from megascore_client.results import HealthStatus, ModelInfo, ScoreResult
from megascore_client.routing import (
    PREFIX_KEY_HEADER,
    PREFIX_KEY_TOKENS,
    ReplicaRouter,
    Resend,
    backoff_s,
    failover_code,
    prefix_key,
)
from megascore_client.splitting import Part, merge, prepare
from megascore_client.trainer_layouts import (
    group_sequences,
    nemo_rl_layout,
    verl_layout,
)
from megascore_client.waiting import ServerWait, check_wait, pinned_version

logger = logging.getLogger(__name__)

__all__ = ["ClientBase", "Route", "finish_score"]

UNRESOLVED = object()
LOAD_WEIGHTS_TIMEOUT_S = 600.0
LOAD_PROGRESS_INTERVAL_S = 1.0
LoadProgress = Callable[[float], None]
"""``progress(elapsed_s)``, called about once a second while a ``load_weights`` runs."""
WaitCallback = Callable[[float, ScoringError | None], None]
"""``on_wait(waited_s, error)``: a request waits for the server (see ``on_wait``)."""


@dataclasses.dataclass(frozen=True)
class Route:
    """Where one Score attempt goes.

    Attributes:
        transport: the replica's transport (the client's own without prefix routing).
        metadata: the call's extra metadata (its prefix key, :data:`PREFIX_KEY_HEADER`).
        index: the replica's index in ``ClientBase.router`` (None without it).
    """

    transport: object
    metadata: tuple
    index: int | None = None


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
        prefix_key_tokens: int = PREFIX_KEY_TOKENS,
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
            retries: retry policy for UNAVAILABLE and a CANCELLED the caller did not
                ask for (:mod:`megascore_client.channel`): a :class:`RetryPolicy`, True
                (default policy: 5 attempts, backoff 0.2 s x2 up to 5 s), an int number
                of retries (0-4), or None to disable.
            load_balancing: None (gRPC default, pick_first), "pick_first" or
                "round_robin" (set in the service config), or "prefix": prefix
                affinity (:mod:`megascore_client.routing`): one channel per replica of
                the target (each address of ``ipv4:a,b``; the addresses a ``dns:///``
                name resolves to when the client opens), each Score request to the
                replica its first sequence's first tokens hash to (rendezvous hashing),
                to the next one in its order when that one is overloaded by this
                client's calls or fails UNAVAILABLE; other calls (streams, model info,
                health, loads) go round robin.
            prefix_key_tokens: how many leading tokens of a request's first sequence
                make its prefix key (sent with every Score call as the
                ``x-megascore-prefix-key`` metadata; the routing key under "prefix").
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
        if int(prefix_key_tokens) < 1:
            raise ValueError("prefix_key_tokens must be >= 1")
        prefix = load_balancing == "prefix"
        self.settings = ChannelSettings.build(
            target,
            tls=tls,
            retries=retries,
            token=token,
            max_message_bytes=max_message_bytes,
            load_balancing="round_robin" if prefix else load_balancing,
            keepalive_time_s=keepalive_time_s,
        )
        self.prefix_key_tokens = int(prefix_key_tokens)
        self.router: ReplicaRouter | None = None
        self.replica_settings: list[ChannelSettings] = []
        if prefix:  # one channel per replica; the SDK retries over them (none of gRPC's)
            self.router = ReplicaRouter(replica_targets(target))
            self.replica_settings = [
                dataclasses.replace(self.settings, target=t, load_balancing=None, retries=None)
                for t in self.router.replicas
            ]
        self.timeout = timeout
        self.wait_for_server_s = check_wait(wait_for_server_s, timeout)
        self.max_concurrency = max_concurrency
        self.on_wait = on_wait
        self._token_limit = UNRESOLVED if max_request_tokens == "auto" else max_request_tokens
        self._delta_bases: dict[tuple[str, ...], tuple[str, dict]] = {}  # targets -> kept
        self._server_message_bytes = 0  # ModelInfo.max_message_bytes, with "auto" (0 = unknown)
        self._server_groups = False  # ModelInfo.accepts_sequence_groups, with "auto"
        self._packs: dict[tuple[str, ...], bool] = {}  # push targets -> take `chunks`
        self._open()

    def _open(self) -> None:
        """Opens the transport and, with prefix routing, the replicas' transports
        (``replica_transports``; each client kind its own)."""
        raise NotImplementedError

    def _route(self, part: Part, avoid=frozenset()) -> Route:
        """Where the Score request of ``part`` goes (``avoid``: replicas it failed on);
        counted in flight on its replica until :meth:`_release`."""
        key = prefix_key(part.batch.token_ids, part.batch.lengths, self.prefix_key_tokens)
        metadata = ((PREFIX_KEY_HEADER, key),)
        if self.router is None:
            return Route(self.transport, metadata)
        index = self.router.pick(key, avoid)
        return Route(self.replica_transports[index], metadata, index)

    def _release(self, route: Route, error: ScoringError | None = None) -> None:
        """The attempt on ``route`` ended (``error``: how it failed)."""
        if route.index is not None:
            self.router.release(route.index, error)

    def _before_resend(self, error: ScoringError, route: Route, state: Resend, deadline, request):
        """The delay before re-sending a Score request whose attempt on ``route`` failed
        with ``error``; raises ``error`` (or the schedule's final one) when it is not
        re-sent.

        With prefix routing, a failover code (UNAVAILABLE, CANCELLED by the server)
        re-sends at once to a replica not yet tried (0 s), then after the retry policy's
        backoff, up to its ``max_attempts``; a pinned request refused by a replica avoids
        it. Then (and always without routing) the ``wait_for_server_s`` / pin schedule
        (:meth:`_resend_delay`), after which each re-send gets its attempts again."""
        policy = self.settings.retries
        refused = error.code is grpc.StatusCode.FAILED_PRECONDITION  # a pin, if pinned
        if route.index is not None and (failover_code(error) or refused):
            state.avoid.add(route.index)
        if (
            route.index is not None
            and failover_code(error)
            and not self.transport.closed
            and policy is not None
            and state.attempts < policy.max_attempts
        ):
            state.attempts += 1
            if self.router.untried(state.avoid):
                return 0.0
            state.backoffs += 1
            return backoff_s(policy, state.backoffs)
        state.schedule, delay = self._resend_delay(error, True, deadline, state.schedule, request)
        if error.retryable:  # waiting for the server: each re-send starts afresh
            state.attempts, state.backoffs = 1, 0
            state.avoid.clear()
        return delay

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

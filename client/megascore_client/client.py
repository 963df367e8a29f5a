"""Synchronous client: :class:`ScoringClient` (what it shares with the asyncio client is
:class:`~megascore_client.client_base.ClientBase`)."""

from __future__ import annotations

import collections
import logging
import threading
import time

from megascore.v1 import scoring_pb2 as pb
from megascore_client import health as health_codec
from megascore_client.client_base import (
    LOAD_PROGRESS_INTERVAL_S,
    LOAD_WEIGHTS_TIMEOUT_S,
    UNRESOLVED,
    ClientBase,
    LoadProgress,
    finish_score,
)
from megascore_client.errors import ScoringError, closed_error
from megascore_client.push.client_methods import PushMethods
from megascore_client.results import HealthStatus, LoadWeightsResult, ModelInfo, ScoreResult
from megascore_client.routing import Resend
from megascore_client.splitting import Part, decode_part
from megascore_client.stream import ScoreStream
from megascore_client.text import TextMethods
from megascore_client.trainer_layouts import (
    PaddedLayout,
)
from megascore_client.transport import SyncTransport

logger = logging.getLogger(__name__)

__all__ = ["ScoringClient"]


class ScoringClient(TextMethods, PushMethods, ClientBase):
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
        self.replica_transports = [SyncTransport(s) for s in self.replica_settings]
        self._lock = threading.Lock()

    def __enter__(self) -> ScoringClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled (CANCELLED), later calls
        and requests waiting for the server raise CANCELLED."""
        self.transport.close()
        for transport in self.replica_transports:
            transport.close()

    def _unary(self, method, request, deadline, *, wait: bool = False):
        """One unary call; with ``wait``, re-sent on UNAVAILABLE per ``wait_for_server_s``."""
        schedule = error = None
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
        score_from=None,
        model: str = "",
        reference: str = "",
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
            score_from: the first entry of each sequence whose outputs are returned
                (SGLang's ``logprob_start_len``): one int for every sequence or one per
                sequence, each in ``[0, length]`` (default: 0). The per-token outputs
                before it hold their fill (0.0, top-k ids -1), those from it on equal
                the outputs without it; the losses, ``num_tokens`` and the mismatch
                statistics count only the entries from it on. The server computes no
                output head before it and may read those tokens from its prefix cache
                (``ScoreResult.cached_tokens``).
            model: the weight set to score with, by name (``ModelInfo.models``; "" =
                the default set); a name the server does not serve is NOT_FOUND.
                ``weights_version`` then pins this set's version.
            reference: a second weight set to score the same tokens with in the same
                call: ``ScoreResult.reference_logprobs`` and the KL estimators between
                ``model`` (p) and it (q), ``kl_k1`` / ``kl_k2`` / ``kl_k3`` per token and
                their means over the scored tokens ``kl_mean`` (docs/client.md); its
                version is ``ScoreResult.reference_weights_version``.
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
            score_from=score_from,
            model=model,
            reference=reference,
            request_id=request_id,
        )
        parts, rid = self.prepare_call(sequences, arguments, self.request_token_limit())
        return finish_score(self._send(parts, timeout), rid, start)

    def _send(self, parts: list[Part], timeout: float | None) -> list[ScoreResult]:
        results: list[ScoreResult | None] = [None] * len(parts)
        inflight: collections.deque = collections.deque()

        def collect():
            index, future, deadline, route = inflight.popleft()
            part = parts[index]
            with part.located():
                try:
                    response = route.transport.result(future)
                except ScoringError as exc:
                    self._release(route, exc)
                    # re-sent here (another replica, wait_for_server_s), the others in flight
                    response = self._score_again(part, deadline, route, exc)
                except BaseException:
                    self._release(route)
                    raise
                else:
                    self._release(route)
                results[index] = decode_part(response, part)

        try:
            for index, part in enumerate(parts):
                if len(inflight) >= self.max_concurrency:
                    collect()
                deadline = self._deadline(timeout)
                route = self._route(part)
                try:
                    future = route.transport.start(
                        route.transport.stub.Score, part.request, deadline, route.metadata
                    )
                except BaseException:
                    self._release(route)
                    raise
                inflight.append((index, future, deadline, route))
            while inflight:
                collect()
        finally:
            for _, future, _, route in inflight:
                future.cancel()
                self._release(route)
        return results

    def _score_again(self, part: Part, deadline, route, error: ScoringError):
        """Re-sends the Score request of ``part`` after ``error`` on ``route``, per
        :meth:`ClientBase._before_resend`, until answered (or raises)."""
        state = Resend()
        while True:
            delay = self._before_resend(error, route, state, deadline, part.request)
            if delay and self.transport.sleep(delay):
                raise closed_error()
            route = self._route(part, state.avoid)
            try:
                response = route.transport.call(
                    route.transport.stub.Score, part.request, deadline, route.metadata
                )
            except ScoringError as exc:
                self._release(route, exc)
                error = exc
            except BaseException:
                self._release(route)
                raise
            else:
                self._release(route)
                self._tell_wait(state.schedule, None)
                return response

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
        weight_set: str = "",
        adapter: str = "",
        timeout: float | None = None,
        progress: LoadProgress | None = None,
    ) -> LoadWeightsResult:
        """Asks the server to load new weights ("hf:DIR" / "megatron:DIR" on the server).

        Args:
            model: checkpoint to load (with ``adapter``: a peft adapter directory).
            weights_version: optional label (the server derives one when empty).
            weight_set: the set it replaces ("": the default; an adapter's: its set).
            adapter: load ``model`` as the LoRA adapter of this name (new or replaced).
            timeout: deadline in seconds (default: 600).
            progress: ``progress(elapsed_s)`` about once a second while the server loads
                (the server reports no fraction; the CLI draws it as an elapsed-time line).

        Never re-sent by ``wait_for_server_s``: a reload is heavy and changes the
        server's state (an UNAVAILABLE may come after it started), and a restarted
        server serves the weights it was started with, not the last ones loaded; after
        an UNAVAILABLE the caller decides (``wait_until_serving``, then load again).
        """
        request = pb.LoadWeightsRequest(
            model=model, weights_version=weights_version, weight_set=weight_set, adapter=adapter
        )
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

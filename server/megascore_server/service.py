"""The scoring service: the data plane under every front (gRPC, HTTP).

A front decodes its wire into domain values (:class:`~megascore.api.types.ScoreBatch`,
texts, ids), calls the service and encodes what it returns; admission (the
:class:`~megascore_server.gate.CallGate`), the domain checks
(:func:`~megascore_server.validation.check_request`), the batcher, the model's
description, weight loads and pushes and the tokenizer live here, once. Methods raise
typed errors (:mod:`megascore.api.errors`); each front maps them through
:mod:`megascore_server.error_table`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

import numpy as np

from megascore.api.errors import (
    CheckpointError,
    FailedPreconditionError,
    InvalidRequestError,
    MegascoreError,
    UnavailableError,
    clip,
    quoted,
)
from megascore.api.limits import Limits
from megascore.api.types import ModelInfo, ScoreBatch, ScoreOutput
from megascore_server.batcher import DynamicBatcher
from megascore_server.gate import SHUTTING_DOWN_MESSAGE, CallGate
from megascore_server.push.pusher import WeightPusher
from megascore_server.tokenizer import NO_TOKENIZER, ServerTokenizer
from megascore_server.validation import check_load, check_request

logger = logging.getLogger(__name__)


async def _until_drain(iterator, drained: asyncio.Event):
    """The messages of ``iterator`` until ``drained`` is set; then UNAVAILABLE, also
    while the next message is awaited."""
    iterator = aiter(iterator)
    while True:
        if drained.is_set():
            raise UnavailableError(SHUTTING_DOWN_MESSAGE)
        message = asyncio.ensure_future(anext(iterator, _END))
        woken = asyncio.ensure_future(drained.wait())
        try:
            await asyncio.wait({message, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
        if not message.done():
            message.cancel()
            raise UnavailableError(SHUTTING_DOWN_MESSAGE)
        if message.result() is _END:
            return
        yield message.result()


_END = object()


def new_request_id(prefix: str = "srv") -> str:
    """A request id for a request that brought none."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


@dataclasses.dataclass
class Scored:
    """One request's answer: its checked batch, its output and where the time went."""

    batch: ScoreBatch
    output: ScoreOutput
    queue_ms: float
    compute_ms: float
    num_steps: int
    total_ms: float


@dataclasses.dataclass(frozen=True)
class Description:
    """What ``GetModelInfo`` / ``/v1/models`` say: the model, the limits, the version."""

    info: ModelInfo
    limits: Limits
    max_tokens_per_batch: int
    max_message_bytes: int
    weights_version: str


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A finished weight load."""

    weights_version: str
    previous_weights_version: str
    load_ms: float


class ScoringService:
    """Scoring, the model's description, weight loads and pushes, the tokenizer.

    Every call answers UNAVAILABLE until :meth:`attach` gives it the engine's batcher
    and the gate lets calls in.

    Args:
        gate: admission, readiness and the count of running calls.
        max_tokens_per_batch: step budget, reported in the description.
        max_message_bytes: the gRPC message size limit, reported so that clients split
            batches under it.
        tokenizer: the server's tokenizer, or None.
    """

    def __init__(
        self,
        gate: CallGate,
        *,
        max_tokens_per_batch: int,
        max_message_bytes: int,
        tokenizer: ServerTokenizer | None = None,
    ):
        self.gate = gate
        self.tokenizer = tokenizer
        self._max_tokens_per_batch = max_tokens_per_batch
        self._max_message_bytes = max_message_bytes
        self._batcher: DynamicBatcher | None = None
        self.limits: Limits | None = None
        self._info: ModelInfo | None = None
        self._pusher = WeightPusher()

    def attach(self, batcher: DynamicBatcher, limits: Limits, info: ModelInfo) -> None:
        """Serves the engine behind ``batcher`` (its limits and model description)."""
        self._batcher, self.limits, self._info = batcher, limits, info

    def call(self):
        """Context manager around one call: admitted by the gate, counted while it runs."""
        return self.gate.call()

    async def score(
        self,
        batch: ScoreBatch,
        request_id: str,
        *,
        arrival: float,
        deadline: float | None = None,
        front: str = "grpc",
    ) -> Scored:
        """Checks and scores one request (merged with concurrent ones by the batcher).

        Args:
            batch: the request as its front decoded it (checked here).
            request_id: for logs.
            arrival: ``time.monotonic()`` when it arrived.
            deadline: ``time.monotonic()`` after which it is dropped (None: never).
            front: the front's name, for logs.
        """
        self.gate.check()
        batch = check_request(batch, self.limits)
        batch = self._named_sets(batch)
        result = await self._batcher.submit(request_id, batch, arrival=arrival, deadline=deadline)
        total_ms = (time.monotonic() - arrival) * 1000.0
        logger.info(
            "%s request_id=%s seqs=%d tokens=%d top_k=%d steps=%d queue_ms=%.1f compute_ms=%.1f "
            "total_ms=%.1f weights=%s",
            front,
            request_id,
            batch.num_sequences,
            batch.num_tokens,
            batch.top_k,
            result.num_steps,
            result.queue_ms,
            result.compute_ms,
            total_ms,
            result.output.weights_version,
        )
        return Scored(
            batch, result.output, result.queue_ms, result.compute_ms, result.num_steps, total_ms
        )

    def _named_sets(self, batch: ScoreBatch) -> ScoreBatch:
        """``batch`` naming its weight sets as the engine lists them (the model's own
        name or none: the default), so that the batcher groups them exactly.

        Raises:
            NotFoundError: a ``model`` or ``reference`` not served, naming it.
        """
        model = self._info.served(batch.model).name
        reference = self._info.served(batch.reference, "options.reference").name
        return dataclasses.replace(batch, model=model, reference=batch.reference and reference)

    async def describe(self) -> Description:
        """The model, its current weights version and the server's limits."""
        await self.gate.admit()
        self.gate.check(serving=False)
        info = dataclasses.replace(
            self._batcher.engine_info(), has_tokenizer=self.tokenizer is not None
        )
        return Description(
            info,
            self.limits,
            self._max_tokens_per_batch,
            self._max_message_bytes,
            self._batcher.weights_version,
        )

    @property
    def model_name(self) -> str:
        """The served model's name ("" before an engine is attached)."""
        return "" if self._info is None else self._info.name

    @property
    def weights_version(self) -> str:
        """The version served now ("" before an engine is attached)."""
        return "" if self._batcher is None else self._batcher.weights_version

    async def load_weights(
        self, model: str, weights_version: str, weight_set: str = "", adapter: str = ""
    ) -> Loaded:
        """Loads weights into ``weight_set`` between steps (with ``adapter``: the LoRA
        adapter of that name from peft directory ``model``, over ``weight_set``); a refused
        checkpoint leaves the old ones serving (a read failing midway breaks the replica:
        docs/checkpoints.md, Hot reload)."""
        start = time.monotonic()
        check_load(model, weights_version, weight_set, adapter)
        async with self.gate.call():
            self.gate.check(serving=False)
            new, previous, info = await self._load(model, weights_version, weight_set, adapter)
        if not adapter:  # an adapter leaves the sets' kept copies as they were
            self._pusher.forget_kept()
        self._info = info
        load_ms = (time.monotonic() - start) * 1000.0
        logger.info("weights %r -> %r loaded in %.0f ms", previous, new, load_ms)
        return Loaded(new, previous, load_ms)

    async def _load(self, model: str, version: str, weight_set: str, adapter: str):
        logger.info("loading weights %s (version %r)", quoted(model), version)
        if adapter:
            swap = lambda e: e.load_adapter(adapter, model, version, weight_set)  # noqa: E731
        else:
            swap = lambda e: e.load_weights(model, version, weight_set)  # noqa: E731
        previous = self._batcher.weights_version
        try:
            return await self._batcher.swap_weights(swap, adapter or weight_set)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc.reason}; still serving weights {previous!r}") from exc
        except MegascoreError:
            raise
        except Exception as exc:
            logger.error("LoadWeights %s: unexpected error", quoted(model), exc_info=exc)
            raise CheckpointError(
                f"loading {quoted(model)} failed ({type(exc).__name__}: {clip(str(exc))}); "
                f"still serving weights {previous!r}"
            ) from exc

    async def push_weights(self, request_iterator):
        """Stages pushed weights on every rank, then swaps them in (``megascore_server.push``);
        returns the push's response message. Once the drain begins, the stream's next
        message is refused UNAVAILABLE (the push is dropped), even while it is awaited:
        an idle push (a trainer between two tensors) does not hold the stop."""
        async with self.gate.call():
            self.gate.check(serving=False)
            drained = asyncio.Event()
            with self.gate.waking(drained.set):
                messages = _until_drain(request_iterator, drained)
                response, info = await self._pusher.push(messages, self._batcher)
        self._info = info or self._info
        return response

    async def finish_push(self, push_id: str, commit: bool):
        """Commits or aborts the push a ``push_weights`` prepared."""
        async with self.gate.call():
            self.gate.check(serving=False)
            response, info = await self._pusher.finish(push_id, commit, self._batcher)
        self._info = info or self._info
        return response

    def _require_tokenizer(self) -> ServerTokenizer:
        self.gate.check(serving=False)
        if self.tokenizer is None:
            raise FailedPreconditionError(NO_TOKENIZER)
        return self.tokenizer

    def tokenize(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Token ids of each text (the server's tokenizer).

        Raises:
            FailedPreconditionError: the server has no tokenizer.
        """
        tokenizer = self._require_tokenizer()
        return [tokenizer.encode(text, add_special_tokens) for text in texts]

    def detokenize(
        self, ids: np.ndarray, lengths: np.ndarray, skip_special_tokens: bool = False
    ) -> tuple[list[str], list[str]]:
        """The text of each sequence and the string of each id.

        Raises:
            FailedPreconditionError: the server has no tokenizer.
            InvalidRequestError: an id outside the vocabulary, lengths not matching.
        """
        tokenizer = self._require_tokenizer()
        vocab = self.limits.vocab_size
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            pos = int(np.flatnonzero((ids < 0) | (ids >= vocab))[0])
            raise InvalidRequestError(
                f"token_ids: position {pos} has id {int(ids[pos])}, outside [0, {vocab})"
            )
        if (lengths < 0).any() or int(lengths.sum()) != ids.size:
            raise InvalidRequestError(
                f"lengths: must be >= 0 and sum to the {ids.size} ids, got {lengths.tolist()[:8]}"
            )
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        texts = [
            tokenizer.decode(ids[bounds[i] : bounds[i + 1]], skip_special_tokens)
            for i in range(lengths.size)
        ]
        return texts, [tokenizer.token_string(int(i)) for i in ids]

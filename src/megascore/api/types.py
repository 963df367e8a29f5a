"""Domain objects exchanged between the gRPC layer and the engine (numpy, torch-free).

The servicer converts protobuf messages into :class:`ScoreBatch`, the engine
returns :class:`ScoreOutput`; neither side sees the other's types. Their flat
token layout (offsets, selection, concatenation) is :mod:`megascore.api.layout`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np

from megascore.api import layout, schema
from megascore.api.errors import InvalidRequestError
from megascore.api.limits import (
    Limits,
    RoutingShape,
    check_lengths,
    check_options,
    check_token_ids,
    score_from_problem,
)
from megascore.api.metric_sums import MetricSums
from megascore.api.served_models import ServedModel, resolve


def check_routing(batch: ScoreBatch, limits: Limits) -> None:
    """Checks a routing to replay against the model's routing shape.

    Raises:
        InvalidRequestError: naming the field (and the sequence).
    """
    if batch.routing is None:
        return
    if limits.routing is None:
        raise InvalidRequestError("routing: the served model has no MoE layers to route")
    limits.routing.check(np.asarray(batch.routing), np.asarray(batch.lengths))


def _first_row(bad: np.ndarray, bounds: np.ndarray) -> str:
    """``sequence i position j`` of the first flat row marked in ``bad``."""
    pos = int(np.flatnonzero(bad)[0])
    seq = layout.sequence_at(bounds, pos)
    return f"sequence {seq} position {pos - int(bounds[seq])}"


def check_scored_inputs(batch: ScoreBatch, limits: Limits) -> None:
    """Checks the target ids and rollout logprobs of a batch: the one check of each (the
    wire gate and the engine run it; the per-sequence inputs are checked by the table).

    Raises:
        InvalidRequestError: naming the field and the sequence (and position).
    """
    bounds = layout.offsets(np.asarray(batch.lengths))
    num_tokens = int(bounds[-1])
    if batch.target_ids is not None:
        ids = np.asarray(batch.target_ids)
        k = ids.shape[1] if ids.ndim == 2 else 0
        if ids.ndim != 2 or ids.shape[0] != num_tokens or k < 1:
            raise InvalidRequestError(
                f"target_ids: shape must be [num_tokens={num_tokens}, K], got {list(ids.shape)}"
            )
        if k > limits.max_target_ids:
            raise InvalidRequestError(
                f"target_ids: {k} ids per token, more than max_target_ids {limits.max_target_ids}"
            )
        if not np.issubdtype(ids.dtype, np.integer):
            raise InvalidRequestError(f"target_ids: ids must be integers, got {ids.dtype}")
        bad = ((ids < 0) | (ids >= limits.vocab_size)).any(axis=1)
        bad[bounds[:-1]] = False  # row 0 of a sequence is ignored
        if bad.any():
            raise InvalidRequestError(
                f"target_ids: {_first_row(bad, bounds)}: ids must be in [0, {limits.vocab_size})"
            )
    if batch.rollout_logprobs is not None:
        rollout = np.asarray(batch.rollout_logprobs)
        if rollout.shape != (num_tokens,):
            raise InvalidRequestError(
                f"rollout_logprobs: {rollout.size} values, expected {num_tokens} (one per token)"
            )
        bad = ~np.isfinite(rollout)
        bad[bounds[:-1]] = False  # entry 0 of a sequence is ignored
        if bad.any():
            raise InvalidRequestError(
                f"rollout_logprobs: {_first_row(bad, bounds)}: not finite (NaN or inf)"
            )
    elif batch.return_importance_weights:
        raise InvalidRequestError(
            "options.return_importance_weights: needs rollout_logprobs in the request"
        )


def _schema_fields(cls):
    """Declares on ``cls`` (before ``dataclass``) a field per entry of
    :data:`megascore.api.schema.OPTIONS` (the entry's default) and of
    :data:`megascore.api.schema.INPUTS` (None: not sent), so that a new entry needs no edit here."""
    for opt in schema.OPTIONS:
        cls.__annotations__[opt.name] = type(opt.default).__name__
        setattr(cls, opt.name, opt.default)
    for spec in schema.INPUTS:
        cls.__annotations__[spec.name] = "np.ndarray | None"
        setattr(cls, spec.name, None)
    return cls


@dataclasses.dataclass(frozen=True)
@_schema_fields
class ScoreBatch:
    """One engine step's worth of sequences.

    Besides ``token_ids`` and ``lengths``, a batch has one attribute per option of
    :data:`megascore.api.schema.OPTIONS` (``top_k``, ``losses``, the ``return_*`` flags,
    ``weights_version``: named and defaulted as the entry; ``weights_version`` is
    rank 0's only, see :func:`check_pinned_version`) and one per input array of
    :data:`megascore.api.schema.INPUTS` (None when the request did not send it):

    * loss_mask: uint8 ``[T]`` of 0/1 (None: all ones); entry 0 of each sequence never
      contributes (it has no prediction).
    * temperature: float32 ``[B]`` per-sequence softmax temperature (> 0; None: ones).
    * routing: integer ``[T, num_moe_layers, topk]`` expert ids to replay instead of
      routing (:class:`RoutingShape`, ``megascore.engine.outputs.routing``).
    * target_ids: int64 ``[T, K]`` caller-chosen ids whose logprobs to return at every
      position (row 0 of each sequence ignored).
    * rollout_logprobs: float64 ``[T]`` the rollout engine's logprobs of the tokens
      (entry 0 of each sequence ignored).
    * mismatch_ratio_cap: float32 ``[B]`` the importance-ratio cap of each sequence
      (:mod:`megascore.api.mismatch`; None: the default cap).

    * score_from: int64 ``[B]`` the first entry of each sequence whose outputs are
      returned (None: 0): :meth:`scored_mask`.

    Attributes:
        token_ids: int64 ``[T]``, all sequences concatenated.
        lengths: int64 ``[B]``, every entry >= 1, ``lengths.sum() == T``.
        cache_hits: int64 ``[B]`` leading tokens of each sequence whose keys and values
            the step reads from the prefix cache (a multiple of its block), or None:
            the step's cache plan (``megascore.engine.cache``), set by rank 0 and
            broadcast with the batch; never on the wire.
        cache_slots: int64, per sequence in order, the cache slot of each block of its
            ``cache_hits + length`` positions (-1: none): read below ``cache_hits``,
            written at and after it.
        cache_moves: int64 ``[M, 2]`` blocks every rank moves between the cache's tiers
            before the step, in order: ``(from slot, to slot)``.
    """

    token_ids: np.ndarray
    lengths: np.ndarray
    cache_hits: np.ndarray | None = None
    cache_slots: np.ndarray | None = None
    cache_moves: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_sequences(self) -> int:
        return int(self.lengths.shape[0])

    def __getattr__(self, name: str):
        """``num_<input>`` for every head input of the table (:attr:`schema.Input.head`,
        e.g. ``num_target_ids``): its trailing size, 0 when the batch does not carry it."""
        spec = next((s for s in schema.INPUTS if s.head and name == f"num_{s.name}"), None)
        if spec is None:
            raise AttributeError(name)
        values = getattr(self, spec.name)
        return 0 if values is None else int(np.shape(values)[1])

    def offsets(self) -> np.ndarray:
        """int64 ``[B+1]`` start of each sequence in ``token_ids`` (:func:`layout.offsets`)."""
        return layout.offsets(self.lengths)

    def scored_mask(self) -> np.ndarray | None:
        """uint8 ``[T]`` the loss mask with every entry before ``score_from`` zeroed (the
        losses, their token counts and the mismatch statistics count from it); None when
        the batch has neither (all ones)."""
        if self.score_from is None or not np.any(self.score_from):
            return self.loss_mask
        mask = np.ones(self.num_tokens, np.uint8) if self.loss_mask is None else self.loss_mask
        return np.where(self.before_score_from(), 0, mask).astype(np.uint8)

    def before_score_from(self) -> np.ndarray:
        """bool ``[T]``: the entries before their sequence's ``score_from``."""
        if self.score_from is None:
            return np.zeros(self.num_tokens, bool)
        starts = np.repeat(self.offsets()[:-1], self.lengths)
        first = np.repeat(np.asarray(self.score_from, np.int64), self.lengths)
        return np.arange(self.num_tokens) - starts < first

    def cached_tokens(self) -> np.ndarray:
        """int64 ``[B]`` tokens of each sequence read from the prefix cache."""
        if self.cache_hits is None:
            return np.zeros(self.num_sequences, np.int64)
        return np.asarray(self.cache_hits, np.int64)

    def temperatures(self) -> np.ndarray:
        """float32 ``[B]`` temperatures (ones when unset)."""
        if self.temperature is None:
            return np.ones(self.num_sequences, dtype=np.float32)
        return self.temperature

    def check(self, limits: Limits) -> None:
        """The engine's one check of a batch, before any collective.

        The wire gate (``megascore_server.validation``) checks requests first with the
        same checks; this guards the engine against whatever reaches it (a merged step,
        a direct caller).

        Args:
            limits: what the engine accepts.

        Raises:
            InvalidRequestError: naming the offending field (and sequence).
        """
        ids, lengths = np.asarray(self.token_ids), np.asarray(self.lengths)
        if ids.ndim != 1 or lengths.ndim != 1:
            raise InvalidRequestError("token_ids and lengths must be 1-D")
        check_lengths(lengths, limits)
        bounds = layout.offsets(lengths)
        if int(bounds[-1]) != ids.size:
            raise InvalidRequestError(f"lengths sum to {int(bounds[-1])}, token_ids has {ids.size}")
        check_token_ids(ids, bounds, limits)
        if self.loss_mask is not None and np.shape(self.loss_mask) != (ids.size,):
            raise InvalidRequestError(f"loss_mask must have {ids.size} entries")
        for spec in schema.INPUTS:
            values = getattr(self, spec.name)
            if spec.per == schema.SEQUENCE and values is not None:
                if np.shape(values) != (lengths.size,):
                    raise InvalidRequestError(f"{spec.name}: one value per sequence")
                rule = schema.check_input(spec.name, values)
                if rule is not None:  # the table's one check of it
                    raise InvalidRequestError(f"{spec.name}: every value {rule}")
        if self.score_from is not None:
            problem = score_from_problem(self.score_from, lengths)
            if problem is not None:
                raise InvalidRequestError(problem)
        check_options(self, limits)
        check_routing(self, limits)
        check_scored_inputs(self, limits)


@dataclasses.dataclass
class ScoreOutput:
    """Engine results for one :class:`ScoreBatch`, in the batch's token layout.

    ``values`` holds the outputs of :data:`megascore.api.schema.OUTPUTS` by name; read them
    as attributes (``output.logprobs``; None when not computed, ``{}`` for a map
    output). In the batch's flat layout: a per-token output is ``[T, *dims]`` of the
    entry's dtype (a predicted one holds its ``fill`` at entry 0 of each sequence, where
    there is no prediction); a per-sequence one ``[B]`` (``[B, *dims]`` with trailing
    dims: the next token's ``[B, max(1, top_k)]``), a map one name -> ``[B]``.
    What each holds is documented on its ``ScoreResult`` attribute (the entry's
    ``sdk``); ``num_loss_tokens`` (the tokens that contributed to the losses,
    :func:`megascore.api.layout.count_loss_tokens`) is set by every engine.

    Attributes:
        values: output name -> array (a map output: name -> dict of ``[B]`` arrays).
        moe_metrics: MoE metric name -> value for this forward.
        mtp_metrics: MTP metric name -> value for this forward.
        metric_sums: what the metrics were formed from, where they add over steps
            (``metrics_reduction`` "step"); None otherwise.
        weights_version: version of the weights that produced these numbers.
        reference_weights_version: with ``ScoreBatch.reference``, the version of the
            reference set (or adapter) that produced ``reference_logprobs``; "" else.
    """

    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    moe_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    mtp_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    metric_sums: MetricSums | None = None
    weights_version: str = ""
    reference_weights_version: str = ""

    def __getattr__(self, name: str):
        for out in schema.OUTPUTS:
            if out.name == name:
                default = {} if out.keys is not None else None
                return self.__dict__.get("values", {}).get(name, default)
        raise AttributeError(f"{type(self).__name__} has no attribute or output {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if any(out.name == name for out in schema.OUTPUTS):
            self.values[name] = value
        else:
            super().__setattr__(name, value)


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    world_size: int = 1
    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1


@dataclasses.dataclass
class ModelInfo:
    """What the served model is and what it accepts (``megascore.v1.ModelInfo``).

    The limits live in ``limits`` only; ``vocab_size``, ``max_sequence_length``,
    ``max_top_k``, ``loss_names`` and ``routing`` read them. ``models`` lists the names a
    request's ``model`` may take (the weight sets, the default first; docs/engine.md
    "Weight sets"), each with its weights version; ``weights_version`` is the default's.
    """

    name: str
    architecture: str
    num_parameters: int
    dtype: str
    parallel: ParallelLayout
    attention_backend: str
    limits: Limits
    checkpoint_path: str = ""
    weights_version: str = ""
    has_tokenizer: bool = False
    moe_metric_names: tuple[str, ...] = ()
    mtp_metric_names: tuple[str, ...] = ()
    models: tuple[ServedModel, ...] = ()

    def served(self, name: str, field: str = "options.model") -> ServedModel:
        """The entry of ``models`` a request's ``name`` selects ("" or :attr:`name`: the
        default; an engine that lists none serves one, as this model).

        Raises:
            NotFoundError: naming ``name`` and ``field``.
        """
        models = self.models or (ServedModel(self.name, self.weights_version),)
        return resolve(models, self.name, name, field)

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    @property
    def max_sequence_length(self) -> int:
        return self.limits.max_sequence_length

    @property
    def max_top_k(self) -> int:
        return self.limits.max_top_k

    @property
    def loss_names(self) -> tuple[str, ...]:
        return self.limits.loss_names

    @property
    def routing(self) -> RoutingShape | None:
        """The MoE routing shape (None: no MoE layers, routing cannot be asked for)."""
        return self.limits.routing


WEIGHT_NAMES_HF = 1
"""Weight push names: Hugging Face names of the served family (``megascore.v1.WeightNames``)."""
WEIGHT_NAMES_MEGATRON = 2
"""Weight push names: Megatron state-dict names of the unsharded local-spec model."""
WEIGHT_NAMES_PEFT = 3
"""Weight push names: a LoRA adapter's peft tensor names (``get_peft_model_state_dict``)."""

LAYOUT_COMMON = 0
"""A pushed tensor name every HF layout of the family shares."""
LAYOUT_PER_EXPERT = 1
"""HF MoE experts one tensor per expert (``block_sparse_moe.experts.E.w1.weight``)."""
LAYOUT_FUSED = 2
"""HF MoE experts stacked (transformers >= 5: ``mlp.experts.gate_up_proj``)."""


@dataclasses.dataclass(frozen=True)
class WeightTarget:
    """A tensor name a weight push may carry.

    Attributes:
        shape: its full (unsharded) shape.
        layout: ``LAYOUT_*``: a push uses one non-common layout only.
        ignored: accepted and dropped (tied ``lm_head.weight``, rotary ``inv_freq``).
    """

    shape: tuple[int, ...]
    layout: int = LAYOUT_COMMON
    ignored: bool = False


class Engine(Protocol):
    """What the server needs from a scoring engine.

    ``score`` and ``load_weights`` are called from one executor thread only, one
    call at a time; they may block for the duration of a forward step.
    """

    def info(self) -> ModelInfo: ...

    def check(self, batch: ScoreBatch) -> None:
        """Checks one batch against the model (:meth:`ScoreBatch.check`, cheap, no
        collective); raises :class:`~megascore.api.errors.InvalidRequestError`. ``score``
        runs it on every step; the batcher runs it per request to single out the one
        that failed a merged step."""
        ...

    def score(self, batch: ScoreBatch) -> ScoreOutput: ...

    def load_weights(self, model: str, weights_version: str, weight_set: str = "") -> str:
        """Loads new weights into ``weight_set`` ("": the default); returns its new weights
        version. Raises on failure, leaving the old weights in place."""
        ...

    def begin_weight_update(self, names: int, weight_set: str = "") -> dict[str, WeightTarget]:
        """Opens a weight push (``WEIGHT_NAMES_*``) into ``weight_set`` ("": the default);
        returns every name it may carry. Discards what an unfinished earlier push staged."""
        ...

    def stage_weight(
        self, name: str, dtype: str, shape: tuple[int, ...], data: bytearray, layout: int
    ) -> None:
        """Stages one full tensor (raw bytes of ``dtype``) of the open push on every rank;
        the served weights do not change. ``name`` and ``shape`` were checked against
        :meth:`begin_weight_update`'s targets by the caller."""
        ...

    def commit_weights(self, weights_version: str, partial: bool) -> str:
        """Swaps the staged tensors in on every rank at once; returns the new version.
        Raises (old weights kept everywhere) when some rank cannot."""
        ...

    def abort_weight_update(self) -> None:
        """Drops the open push's staged tensors on every rank."""
        ...

    def shutdown(self) -> None: ...

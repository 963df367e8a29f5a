"""What a request or a batch must respect: the served model's limits and the checks
that read them alone (options, pinned version, lengths, token ids, the routing shape).

numpy only. The checks that need a whole batch (its routing, its scored inputs) are
:mod:`megascore.api.types`'s, beside :class:`~megascore.api.types.ScoreBatch`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megascore.api import layout, schema
from megascore.api.errors import InvalidRequestError, WrongVersionError, quoted


@dataclasses.dataclass(frozen=True)
class RoutingShape:
    """What a MoE routing array of the served model looks like
    (``megascore.engine.outputs.routing``).

    A routing holds, for every token, for every MoE layer of the decoder in order, the
    ``topk`` expert ids the router chose: integer ``[T, num_moe_layers, topk]``.

    Attributes:
        num_moe_layers: MoE layers of the decoder (``L``).
        topk: experts per token and layer (``k``).
        num_experts: routed experts; ids are in ``[0, num_experts)``.
    """

    num_moe_layers: int
    topk: int
    num_experts: int

    def check(self, routing: np.ndarray, lengths: np.ndarray, field: str = "routing") -> None:
        """Checks a routing given for sequences of ``lengths``.

        Args:
            routing: ``[T, L, k]`` expert ids in the flat token layout.
            lengths: int64 ``[B]`` sequence lengths (``T = lengths.sum()``).
            field: the name used in messages.

        Raises:
            InvalidRequestError: naming ``field`` (and the first offending sequence):
                another shape, non-integer values, ids outside ``[0, num_experts)``, or
                an expert twice in one token's layer.
        """
        bounds = layout.offsets(lengths)
        want = (int(bounds[-1]), self.num_moe_layers, self.topk)
        if np.shape(routing) != want:
            raise InvalidRequestError(
                f"{field}: shape must be [num_tokens, num_moe_layers, topk] = {list(want)}, "
                f"got {list(np.shape(routing))}"
            )
        if not np.issubdtype(routing.dtype, np.integer):
            raise InvalidRequestError(f"{field}: expert ids must be integers, got {routing.dtype}")
        bad = np.flatnonzero(((routing < 0) | (routing >= self.num_experts)).any(axis=(1, 2)))
        if bad.size:
            raise InvalidRequestError(
                f"{field}: sequence {layout.sequence_at(bounds, int(bad[0]))}: expert ids "
                f"must be in [0, {self.num_experts})"
            )
        ordered = np.sort(routing, axis=-1)
        dup = np.flatnonzero((ordered[..., 1:] == ordered[..., :-1]).any(axis=(1, 2)))
        if dup.size:
            raise InvalidRequestError(
                f"{field}: sequence {layout.sequence_at(bounds, int(dup[0]))}: the {self.topk} "
                "expert ids of a token in one layer must be distinct"
            )


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a request or a batch must respect: the one limits record.

    The engine builds it from the model (``ModelInfo.limits``), the server tightens the
    length and adds the per-request token limit (``megascore_server.lifecycle``), and
    the wire gate, :meth:`ScoreBatch.check` and the ``ModelInfo`` message all read it.

    Attributes:
        vocab_size: token ids must be below it.
        max_sequence_length: longest sequence accepted.
        max_top_k: largest ``top_k`` accepted.
        max_target_ids: largest number of target ids per token accepted (0: none).
        loss_names: the losses the engine computes.
        metrics_supported: whether MoE / MTP metrics can be computed in this layout
            (:meth:`megascore.config.EngineConfig.metrics_supported`).
        routing: the model's MoE routing shape; None for a model without MoE layers.
        max_request_tokens: most tokens in one request (the server's); None: no limit.
        mtp_not_served: why the MTP layers the checkpoint declares are not served ("" when
            none are left out); MTP metrics are then refused with it.
        metric_groups: the metric groups the model reports: "moe" (it has MoE layers),
            "mtp" (MTP layers). Asking for another is refused, like routing of a dense
            model (the engine sets them from the model).
    """

    vocab_size: int
    max_sequence_length: int
    max_top_k: int
    loss_names: tuple[str, ...]
    max_target_ids: int = 0
    metrics_supported: bool = True
    routing: RoutingShape | None = None
    max_request_tokens: int | None = None
    mtp_not_served: str = ""
    metric_groups: tuple[str, ...] = ("moe", "mtp")


def check_options(values, limits: Limits) -> None:
    """Checks request options (attributes named as :data:`megascore.api.schema.OPTIONS`:
    a ``ScoreBatch`` or a ``pb.ScoreOptions``) against ``limits``: the one option check.

    Raises:
        InvalidRequestError: ``options.<name>: ...``.
    """
    for opt in schema.OPTIONS:
        error = opt.check(getattr(values, opt.name), limits) if opt.check else None
        if error:
            sep = "" if error.startswith("[") else ": "
            raise InvalidRequestError(f"options.{opt.name}{sep}{error}")


def check_pinned_version(pinned: str, served: str) -> None:
    """The one check of a request's ``weights_version`` pin against the version served
    (the batcher before each step; the engine at the step, where it owns the version).

    Raises:
        WrongVersionError: ``pinned`` is set and is not ``served``.
    """
    if pinned and pinned != served:
        raise WrongVersionError(
            f"options.weights_version: the request is pinned to weights {quoted(pinned)}, "
            f"this replica serves {quoted(served)}"
        )


def check_lengths(lengths: np.ndarray, limits: Limits, field: str = "lengths") -> None:
    """Checks sequence lengths: the one length check.

    Raises:
        InvalidRequestError: an empty batch or a length outside ``[1, max_sequence_length]``.
    """
    if lengths.size == 0:
        raise InvalidRequestError(f"{field}: empty batch (at least one sequence is required)")
    bad = np.flatnonzero(lengths < 1)
    if bad.size:
        i = int(bad[0])
        raise InvalidRequestError(
            f"{field}: sequence {i} has length {int(lengths[i])}; every length must be >= 1"
        )
    bad = np.flatnonzero(lengths > limits.max_sequence_length)
    if bad.size:
        i = int(bad[0])
        raise InvalidRequestError(
            f"{field}: sequence {i} has length {int(lengths[i])}, longer than "
            f"max_sequence_length {limits.max_sequence_length}"
        )


def check_token_ids(ids: np.ndarray, bounds: np.ndarray, limits: Limits) -> None:
    """Checks every id is in ``[0, vocab_size)``: the one vocabulary check.

    Raises:
        InvalidRequestError: naming the sequence and position of the first bad id.
    """
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= limits.vocab_size):
        pos = int(np.flatnonzero((ids < 0) | (ids >= limits.vocab_size))[0])
        seq = layout.sequence_at(bounds, pos)
        raise InvalidRequestError(
            f"token_ids: sequence {seq} position {pos - int(bounds[seq])} has id "
            f"{int(ids[pos])}, outside [0, {limits.vocab_size})"
        )


def score_from_problem(values, lengths) -> str | None:
    """What is wrong with ``score_from`` (one integer in ``[0, length]`` per sequence),
    naming the first sequence that breaks it, or None: the one rule the client, the wire
    gate and ``ScoreBatch.check`` run."""
    given, lengths = np.asarray(values), np.asarray(lengths)
    if given.shape != lengths.shape:
        return f"score_from: has {given.size} values, expected {lengths.size} (one per sequence)"
    if given.dtype.kind not in "iu":
        whole = np.zeros(given.shape, bool)
        if given.dtype.kind == "f":
            whole = np.isfinite(given) & (np.floor(given) == given)
        if not whole.all():
            seq = int(np.flatnonzero(~whole)[0])
            return (
                f"score_from: sequence {seq}: {given[seq]!r} is not an integer; it must be an "
                "integer in [0, the sequence length]"
            )
    bad = np.flatnonzero((given < 0) | (given > lengths))
    if bad.size:
        seq = int(bad[0])
        return (
            f"score_from: sequence {seq}: {int(given[seq])} is outside [0, {int(lengths[seq])}] "
            "(0 to the sequence length)"
        )
    return None

"""Splitting a call's batch into requests under the message limit, and merging the answers.

A call's batch is cut, in order, into consecutive runs of sequences whose request
*and* response both fit the message limit (the channel's, or the server's
``ModelInfo.max_message_bytes`` when known and smaller; the server uses one limit
for what it receives and sends) and, when known, the server's
``max_request_tokens``. Sizes are estimated per token and per sequence: a request
carries ``lengths`` (8 bytes a sequence), ``score_from`` when given (8 more; each part
carries its own sequences' values) and, per token, each array it sends (ids,
mask, routing to replay, ...: itemsize x values per token); a response the ``lengths``
echo and every output of :data:`megascore.api.schema.OUTPUTS` the request asks for
(:func:`response_bytes`: itemsize x values per token, e.g. ``top_k`` ids and logprobs,
or per sequence, one per key of a map such as the losses); a fixed reserve covers
headers, strings and metric maps. A routing asked for without one to replay has ``L * k``
unknown before the answer: ``ROUTING_VALUES_GUESS`` (64 MoE layers x top-8) stands in,
for cutting only (a sequence over the guessed size still goes alone, and the server
answers RESOURCE_EXHAUSTED if its response really is too large).

Merging a split batch concatenates the per-sequence results in order; MoE / MTP
metrics, which the server reports per request, become the token-weighted mean over
the requests (weights = tokens of each request), i.e. the value a single request
would have reported for metrics that are per-token averages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import uuid

import numpy as np

from megascore.api import schema
from megascore.api.prompt_groups import find_groups, wire_rows
from megascore.api.wire import decode_array, encode_array
from megascore.v1 import scoring_pb2 as pb
from megascore_client.errors import InvalidInputError, ScoringError, malformed_response
from megascore_client.inputs import Batch, make_batch
from megascore_client.results import ScoreResult, Timings

__all__ = [
    "Part",
    "ScoreOptions",
    "build_parts",
    "decode_part",
    "merge",
    "new_request_id",
    "plan",
    "prepare",
]

METRIC_GROUPS = ("moe", "mtp")
ROUTING_VALUES_GUESS = 64 * 8
"""Routing values per token assumed when sizing a response whose routing shape is unknown."""
_RESERVE_BYTES = 8192
_SAFETY = 0.97


def _metric_flag(group: str) -> property:
    return property(lambda self: group in self.metrics, doc=f"Whether ``metrics`` has {group!r}.")


def _schema_options(cls):
    """Declares on ``cls`` (before ``dataclass``) a field for every option of
    :data:`megascore.api.schema.OPTIONS` it does not spell itself, named and defaulted as the
    entry (``return_logprobs``, ``return_routing``, ``weights_version``, ...), and reads
    the ``return_<group>_metrics`` options from ``metrics``: every option then has its
    wire field's name, and a new one needs no edit here."""
    for group in METRIC_GROUPS:
        setattr(cls, f"return_{group}_metrics", _metric_flag(group))
    cls._table_options = tuple(opt for opt in schema.OPTIONS if not hasattr(cls, opt.name))
    for opt in cls._table_options:
        default = opt.default if opt.names is None else next(iter(opt.names))
        cls.__annotations__[opt.name] = type(default).__name__
        setattr(cls, opt.name, default)
    return cls


@dataclasses.dataclass(frozen=True)
@_schema_options
class ScoreOptions:
    """What to compute (see ``ScoringClient.score``): the arguments below, and one per
    other option of :data:`megascore.api.schema.OPTIONS` (the ``return_*`` flags,
    ``weights_version``: the entry's name and default; an enum option such as
    ``logprob_positions`` by name, its first name the default; None stands for the
    default)."""

    top_k: int = 0
    temperature: float = 1.0
    losses: tuple[str, ...] = ("nll",)
    metrics: tuple[str, ...] = ()
    mismatch_ratio_cap: float | None = None

    def __post_init__(self):
        for opt in self._table_options:  # as the wire field takes it
            value = getattr(self, opt.name)
            if opt.names is not None:  # an enum by name
                value = next(iter(opt.names)) if value is None else value
                if value not in opt.names:
                    raise InvalidInputError(
                        f"{opt.name} must be one of {list(opt.names)}, got {value!r}"
                    )
            else:
                value = opt.default if value is None else type(opt.default)(value)
            object.__setattr__(self, opt.name, value)
        losses = (self.losses,) if isinstance(self.losses, str) else tuple(self.losses)
        metrics = (self.metrics,) if isinstance(self.metrics, str) else tuple(self.metrics)
        object.__setattr__(self, "losses", losses)
        object.__setattr__(self, "metrics", metrics)
        if not isinstance(self.top_k, int | np.integer) or self.top_k < 0:
            raise InvalidInputError(f"top_k must be an int >= 0, got {self.top_k!r}")
        object.__setattr__(self, "top_k", int(self.top_k))
        for name in ("temperature", "mismatch_ratio_cap"):  # the table's one check of each
            value = getattr(self, name)
            rule = None if value is None else schema.check_input(name, value)
            if rule is not None:
                raise InvalidInputError(f"{name} {rule}, got {value!r}")
        object.__setattr__(self, "temperature", float(self.temperature))
        unknown = set(metrics) - set(METRIC_GROUPS)
        if unknown:
            raise InvalidInputError(f"metrics must be among {METRIC_GROUPS}, got {sorted(unknown)}")

    def _wire_value(self, opt: schema.Option):
        value = getattr(self, opt.name)
        return value if opt.names is None else opt.names[value]

    def to_proto(self) -> pb.ScoreOptions:
        options = pb.ScoreOptions(
            temperature=self.temperature,
            **{opt.name: self._wire_value(opt) for opt in schema.OPTIONS},
        )
        if self.mismatch_ratio_cap is not None:
            options.mismatch_ratio_cap = float(self.mismatch_ratio_cap)
        return options


@dataclasses.dataclass
class Part:
    """One gRPC request of a call and what is needed to decode its response.

    Attributes:
        request: the encoded request.
        batch: its sequences (views of the call's batch).
        options: the call's options.
        start: index in the call's batch of its first sequence (the server's sequence
            indices in an error about this request are relative to it).
    """

    request: pb.ScoreRequest
    batch: Batch
    options: ScoreOptions
    start: int = 0

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[n]`` lengths of its sequences."""
        return self.batch.lengths

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @contextlib.contextmanager
    def located(self):
        """Marks a ``ScoringError`` raised inside with the part's ``start`` (its
        ``sequence_offset``), so that ``sequence_index`` counts in the call's batch."""
        try:
            yield
        except ScoringError as exc:
            exc.sequence_offset = self.start
            raise


def new_request_id() -> str:
    """A fresh client-side request id (16 hex chars)."""
    return uuid.uuid4().hex[:16]


def plan(
    batch: Batch,
    options: ScoreOptions,
    *,
    max_message_bytes: int,
    max_request_tokens: int | None = None,
) -> list[tuple[int, int]]:
    """Cuts the batch into ``[start, stop)`` sequence ranges that fit the limits.

    Args:
        batch: the call's batch.
        options: the call's options (they set the response size).
        max_message_bytes: the message size limit, both directions (the smaller of
            the client's and the server's).
        max_request_tokens: the server's per-request token limit (None = none).

    Returns:
        Consecutive ranges covering all sequences, in order.

    Raises:
        InvalidInputError: one sequence alone exceeds a limit.
    """
    lengths = batch.lengths
    # The reserve shrinks under 32 KiB so that a server's small limit stays usable.
    budget = int(max_message_bytes * _SAFETY) - min(_RESERVE_BYTES, max_message_bytes // 4)
    req_tok = sum(
        values.itemsize * math.prod(values.shape[1:]) for values in batch.per_token().values()
    )
    req_seq = lengths.itemsize + sum(v.itemsize for v in batch.per_sequence().values())
    resp_tok, resp_seq, guessed = response_bytes(options, batch)
    zero = np.zeros(1, dtype=np.int64)
    request_cost = np.cumsum(lengths * req_tok + req_seq)
    response_cost = np.cumsum(lengths * resp_tok + resp_seq)
    prefixes = [  # (prefix sums, limit, what, whether a size over the limit is an error)
        (np.concatenate([zero, request_cost]), budget, "request bytes", True),
        (np.concatenate([zero, response_cost]), budget, "response bytes", not guessed),
    ]
    if max_request_tokens:
        tokens = np.concatenate([zero, np.cumsum(lengths)])
        prefixes.append((tokens, max_request_tokens, "tokens", True))
    ranges, start, count = [], 0, len(lengths)
    while start < count:
        stop = count
        for prefix, limit, what, strict in prefixes:
            end = int(np.searchsorted(prefix, prefix[start] + limit, side="right")) - 1
            if end <= start and not strict:
                end = start + 1
            elif end <= start:
                raise InvalidInputError(
                    f"sequences[{start}]: {int(prefix[start + 1] - prefix[start])} {what} "
                    f"exceed the per-request limit of {limit}"
                )
            stop = min(stop, end)
        ranges.append((start, stop))
        start = stop
    return ranges


def build_parts(
    batch: Batch,
    options: ScoreOptions,
    request_id: str,
    *,
    max_message_bytes: int,
    max_request_tokens: int | None = None,
    groups: bool = False,
) -> list[Part]:
    """Plans the batch and encodes one ``ScoreRequest`` per range.

    A single request carries ``request_id``; parts of a split call carry
    ``"{request_id}/{i}"``. With ``groups`` (a server with
    ``ModelInfo.accepts_sequence_groups``), consecutive sequences of a request that
    share a prompt of at least ``MIN_SHARED_PROMPT`` tokens travel as a group, the
    prompt's rows of every per-token array sent once (``ScoreRequest.groups``); the
    server expands them, so the results are those of the request without groups.
    """
    ranges = plan(
        batch, options, max_message_bytes=max_message_bytes, max_request_tokens=max_request_tokens
    )
    proto_options = options.to_proto()
    parts = []
    for i, (start, stop) in enumerate(ranges):
        sub = batch.slice(start, stop)
        request = pb.ScoreRequest(
            request_id=request_id if len(ranges) == 1 else f"{request_id}/{i}",
            lengths=encode_array(sub.lengths),
            options=proto_options,
        )
        arrays = sub.per_token()
        found = find_groups(sub.lengths, list(arrays.values())) if groups else None
        rows = slice(None)
        if found is not None:  # each shared prompt once (megascore.api.prompt_groups)
            request.groups.sizes.CopyFrom(encode_array(found[0]))
            request.groups.prompt_lengths.CopyFrom(encode_array(found[1]))
            rows = wire_rows(sub.lengths, *found)
        for name, values in arrays.items():
            getattr(request, name).CopyFrom(encode_array(values[rows]))
        for name, values in sub.per_sequence().items():  # one per sequence, groups or not
            getattr(request, name).CopyFrom(encode_array(values))
        parts.append(Part(request=request, batch=sub, options=options, start=start))
    return parts


BATCH_ARGUMENTS = (
    "loss_mask",
    "lengths",
    "routing",
    "target_ids",
    "rollout_logprobs",
    "score_from",
    "request_id",
)
"""``score`` arguments that describe the batch; the others are :class:`ScoreOptions`."""


def prepare(
    sequences,
    arguments: dict,
    *,
    max_message_bytes: int,
    max_request_tokens: int | None = None,
    groups: bool = False,
) -> tuple[list[Part], str]:
    """Checks a call's arguments and cuts its batch into requests (``score`` and the
    streams' ``submit``).

    Args:
        sequences: as for ``ScoringClient.score``.
        arguments: the call's other keyword arguments (those of ``ScoringClient.score``
            but ``timeout``): :data:`BATCH_ARGUMENTS` and the :class:`ScoreOptions`.
        max_message_bytes: the message size limit (see :func:`plan`).
        max_request_tokens: the server's per-request token limit (None = none).
        groups: send shared prompts once (see :func:`build_parts`).

    Returns:
        The parts, in order, and the call's request id.

    Raises:
        InvalidInputError: the input is rejected.
        TypeError: an unknown argument.
    """
    options = ScoreOptions(**{k: v for k, v in arguments.items() if k not in BATCH_ARGUMENTS})
    batch = {k: arguments.get(k) for k in BATCH_ARGUMENTS}
    rid = batch.pop("request_id") or new_request_id()
    parts = build_parts(
        make_batch(sequences, **batch),
        options,
        rid,
        max_message_bytes=max_message_bytes,
        max_request_tokens=max_request_tokens,
        groups=groups,
    )
    return parts, rid


_ITEMSIZE = {pb.DTYPE_INT32: 4, pb.DTYPE_INT64: 8, pb.DTYPE_FLOAT32: 4, pb.DTYPE_FLOAT64: 8}
_DTYPES = {  # schema dtype -> wire dtype
    "int32": pb.DTYPE_INT32,
    "int64": pb.DTYPE_INT64,
    "float32": pb.DTYPE_FLOAT32,
    "float64": pb.DTYPE_FLOAT64,
}


def _decode(array: pb.Array, field: str, dtype: int, count: int) -> np.ndarray:
    """Decodes a response array after checking it is exactly ``count`` values of
    ``dtype`` (the response contract), so that the codec has nothing left to refuse."""
    if array.dtype != dtype:
        got = pb.Dtype.Name(array.dtype) if array.dtype in pb.Dtype.values() else array.dtype
        raise malformed_response(f"{field} has dtype {got}, expected {pb.Dtype.Name(dtype)}")
    if len(array.data) != count * _ITEMSIZE[dtype]:
        raise malformed_response(
            f"{field} has {len(array.data)} bytes, expected {count} values "
            f"({count * _ITEMSIZE[dtype]} bytes)"
        )
    return decode_array(array, field, allowed=(dtype,)).copy()


class Asked:
    """What a request asks for, read like a ``ScoreBatch`` by the output table's
    ``wanted`` / ``dims`` / ``keys``: its options by name, then its batch's attributes
    (``target_ids``, ``num_target_ids``, ...; None for an input the client does not send)."""

    def __init__(self, options: ScoreOptions, batch: Batch):
        self._options, self._batch = options, batch

    def __getattr__(self, name: str):
        options, batch = self.__dict__["_options"], self.__dict__["_batch"]
        return getattr(options, name) if hasattr(options, name) else getattr(batch, name, None)


def response_bytes(options: ScoreOptions, batch: Batch) -> tuple[int, int, bool]:
    """The estimated response size of a request of ``batch`` asking ``options``: bytes per
    token and per sequence of the outputs of :data:`megascore.api.schema.OUTPUTS` it asks for
    (itemsize x values per token or sequence; a map: one value per key per sequence), and
    the lengths echo.

    Returns:
        ``(per_token, per_sequence, guessed)``: ``guessed`` when an output shaped by the
        model (the routing) has no input of its name to give its shape (one to replay):
        :data:`ROUTING_VALUES_GUESS` values per token stand in.
    """
    asked = Asked(options, batch)
    per_token, per_sequence, guessed = 0, batch.lengths.itemsize, False
    for out in schema.OUTPUTS:
        if not out.wanted(asked):
            continue
        itemsize = np.dtype(out.dtype).itemsize
        if out.per == schema.SEQUENCE:
            values = math.prod(out.dims(asked)) if out.keys is None else len(out.keys(asked))
            per_sequence += itemsize * values
        elif out.dims is not None:
            per_token += itemsize * math.prod(out.dims(asked))
        else:  # shaped by the model
            given = getattr(batch, out.name, None)
            guessed = guessed or given is None
            values = ROUTING_VALUES_GUESS if given is None else math.prod(given.shape[1:])
            per_token += itemsize * values
    return per_token, per_sequence, guessed


def _decode_output(response: pb.ScoreResponse, out: schema.Output, part: Part):
    """One output of :data:`megascore.api.schema.OUTPUTS` of a response, in the
    ``ScoreResult`` layout (per token: one array per sequence; per sequence: one
    ``[B, *dims]`` array)."""
    num_seqs, num_tokens = int(part.lengths.shape[0]), part.num_tokens
    dtype = _DTYPES[out.dtype]
    if out.keys is not None:
        field = getattr(response, out.wire)
        decoded = {}
        for key in out.keys(Asked(part.options, part.batch)):
            if key not in field:
                raise malformed_response(f"{out.wire}[{key}] missing")
            decoded[key] = _decode(field[key], f"{out.wire}[{key}]", dtype, num_seqs)
        return decoded
    rows = num_seqs if out.per == schema.SEQUENCE else num_tokens
    dims = tuple(getattr(response, name) for name in out.wire_dims)
    if dims and min(dims) <= 0:
        raise malformed_response(f"{out.wire} shape {(rows, *dims)} for a request asking for it")
    flat = _decode(getattr(response, out.wire), out.wire, dtype, rows * math.prod(dims))
    if out.per == schema.SEQUENCE:
        return flat.reshape(rows, *dims)
    return np.split(flat.reshape(rows, *dims), np.cumsum(part.lengths)[:-1])


def decode_part(response: pb.ScoreResponse, part: Part) -> ScoreResult:
    """Decodes the response to one part into a :class:`ScoreResult`: every output of
    :data:`megascore.api.schema.OUTPUTS` the request asked for, checked for dtype and size.

    Raises:
        ScoringError: (INTERNAL) the response does not match the request.
    """
    sent_id = part.request.request_id
    if response.request_id != sent_id:
        raise malformed_response(f"request_id {response.request_id!r} answers {sent_id!r}")
    lengths = part.lengths
    if response.HasField("lengths"):
        echoed = _decode(response.lengths, "lengths", pb.DTYPE_INT64, int(lengths.shape[0]))
        if not np.array_equal(echoed, lengths):
            raise malformed_response("lengths differ from the request's")
    result = ScoreResult(request_id=sent_id, lengths=lengths.copy(), logprobs=None)
    for out in schema.OUTPUTS:
        if out.optional and not response.HasField(out.wire):
            continue
        if out.wanted(Asked(part.options, part.batch)):
            setattr(result, out.sdk, _decode_output(response, out, part))
    result.moe_metrics = dict(response.moe_metrics)
    result.mtp_metrics = dict(response.mtp_metrics)
    result.weights_version = response.weights_version
    result.reference_weights_version = response.reference_weights_version
    result.timings = Timings.from_proto(response.timings)
    return result


def _weighted_metrics(dicts: list[dict[str, float]], weights: list[int]) -> dict[str, float]:
    totals: dict[str, list[float]] = {}
    for metrics, weight in zip(dicts, weights, strict=True):
        for name, value in metrics.items():
            acc = totals.setdefault(name, [0.0, 0.0])
            acc[0] += value * weight
            acc[1] += weight
    return {name: num / den if den else 0.0 for name, (num, den) in totals.items()}


def _join(values: list, out: schema.Output):
    """The values of one output over a call's parts, in part order."""
    if values[0] is None:
        return None
    if out.keys is not None:
        return {key: np.concatenate([v[key] for v in values]) for key in values[0]}
    if out.per == schema.SEQUENCE:
        return np.concatenate(values)
    return [item for sub in values for item in sub]


def merge(results: list[ScoreResult], request_id: str) -> ScoreResult:
    """Reassembles the results of a call's parts (in part order) into one result."""
    if len(results) == 1:
        result = results[0]
        result.request_id = request_id
        return result
    weights = [int(r.lengths.sum()) for r in results]
    versions = ",".join(dict.fromkeys(r.weights_version for r in results))
    references = ",".join(dict.fromkeys(r.reference_weights_version for r in results))
    joined = {out.sdk: _join([getattr(r, out.sdk) for r in results], out) for out in schema.OUTPUTS}
    return ScoreResult(
        request_id=request_id,
        lengths=np.concatenate([r.lengths for r in results]),
        **joined,
        moe_metrics=_weighted_metrics([r.moe_metrics for r in results], weights),
        mtp_metrics=_weighted_metrics([r.mtp_metrics for r in results], weights),
        weights_version=versions,
        reference_weights_version=references,
        timings=Timings(
            queue_ms=max(r.timings.queue_ms for r in results),
            compute_ms=sum(r.timings.compute_ms for r in results),
            total_ms=max(r.timings.total_ms for r in results),
            num_steps=sum(r.timings.num_steps for r in results),
            num_requests=len(results),
        ),
    )

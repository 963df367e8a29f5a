"""Reading and checking the input rows of ``megascore score``, one line at a time.

Each row is checked where it is read, against the served model (its vocabulary and
longest sequence, from ``GetModelInfo``), before anything is sent. A bad row becomes a
:class:`BadRow` naming ``FILE:LINE``, the row's id and what is wrong; the caller
decides whether to stop or to set it aside (``--skip-invalid``).

Row forms (one JSON value per line; blank lines are ignored)::

    {"id": ..., "token_ids": [...], "loss_mask": [...]}   # id and loss_mask optional
    [...]                                                 # a bare list of token ids
    {"id": ..., "text": "..."}                            # the server's or --tokenizer DIR's

A row without ``id`` is identified by its index among the non-blank lines. An object
row may carry ``"routing"``, a MoE routing to replay: per token, per MoE layer, the
``topk`` expert ids (``[[[e, ...], ...], ...]``, ``[num_tokens][num_moe_layers][topk]``,
as ``megascore score --return-routing`` writes it); the server checks the ids. It may
carry ``"rollout_logprobs"``, the rollout engine's logprob of every token (entry 0
ignored): the output row then holds ``"mismatch"``, the train/inference mismatch
statistics of the row (docs/client.md). It may carry ``"target_ids"``, ids whose
logprobs to return at every position (``[num_tokens][K]``, the same K for every id of
the row; row 0 ignored): the output row then holds ``"target_logprobs"``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

__all__ = [
    "BadRow",
    "Row",
    "RowLimits",
    "check_loss_mask",
    "check_rollout",
    "check_routing",
    "check_target_ids",
    "check_token_ids",
    "key",
    "read_rows",
]


def key(row_id) -> str:
    """The identity of a row id (ids are compared by their JSON text)."""
    return json.dumps(row_id, sort_keys=True)


@dataclasses.dataclass(frozen=True)
class RowLimits:
    """What the served model accepts in one sequence.

    Attributes:
        vocab_size: token ids must be in ``[0, vocab_size)``.
        max_tokens: longest sequence (``max_sequence_length``, or the server's
            ``max_request_tokens`` when smaller: a sequence cannot be split).
        max_tokens_name: the name of the limit that sets ``max_tokens``.
    """

    vocab_size: int
    max_tokens: int
    max_tokens_name: str = "max_sequence_length"

    @classmethod
    def from_model_info(cls, info) -> RowLimits:
        """The limits of a :class:`~megascore_client.results.ModelInfo`."""
        if info.max_request_tokens and info.max_request_tokens < info.max_sequence_length:
            return cls(info.vocab_size, info.max_request_tokens, "max_request_tokens")
        return cls(info.vocab_size, info.max_sequence_length)


@dataclasses.dataclass(frozen=True)
class Row:
    """A checked row: ``token_ids`` and ``loss_mask`` (None = all ones) are lists of ints;
    ``routing`` (None = route) is int32 ``[num_tokens, num_moe_layers, topk]``;
    ``rollout_logprobs`` (None = none) float64 ``[num_tokens]``; ``target_ids`` (None =
    none) int64 ``[num_tokens, K]``."""

    line: int
    id: object
    token_ids: list[int]
    loss_mask: list[int] | None = None
    routing: np.ndarray | None = None
    rollout_logprobs: np.ndarray | None = None
    target_ids: np.ndarray | None = None


class BadRow(Exception):
    """A row that cannot be scored.

    Attributes:
        path: the input file.
        line: its 1-based line number.
        id: the row's id (None when the line does not parse).
        reason: what is wrong, naming the field and position.
    """

    def __init__(self, path: Path, line: int, row_id, reason: str):
        self.path, self.line, self.id, self.reason = path, line, row_id, reason
        super().__init__(str(self))

    def __str__(self) -> str:
        name = "" if self.id is None else f" (id {json.dumps(self.id)})"
        return f"{self.path}:{self.line}{name}: {self.reason}"

    def record(self) -> dict:
        """The row's entry in the side file of ``--skip-invalid``."""
        return {"line": self.line, "id": self.id, "reason": self.reason}


def _kind(value) -> str:
    """How a JSON value is named in a message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    names = {str: "a string", dict: "an object", list: "a list", int: "a number"}
    return names.get(type(value), "a number" if isinstance(value, float) else type(value).__name__)


def check_token_ids(ids, limits: RowLimits) -> str | None:
    """What is wrong with a row's token ids (None when nothing)."""
    if not isinstance(ids, list):
        return f"token_ids is {_kind(ids)}; expected a list of integer token ids"
    if not ids:
        return "empty token sequence (a row needs at least one token)"
    if len(ids) > limits.max_tokens:
        return (
            f"{len(ids)} tokens, more than the model's {limits.max_tokens_name} {limits.max_tokens}"
        )
    if all(type(t) is int for t in ids) and 0 <= min(ids) and max(ids) < limits.vocab_size:
        return None
    for j, t in enumerate(ids):
        if isinstance(t, bool | float):
            return f"token_ids[{j}] = {json.dumps(t)} is not an integer"
        if type(t) is not int:
            return f"token_ids[{j}] is {_kind(t)}, not an integer"
        if t < 0:
            return f"token_ids[{j}] = {t} is negative"
        if t >= limits.vocab_size:
            return f"token_ids[{j}] = {t} is not below the model's vocab_size {limits.vocab_size}"
    return None


def check_loss_mask(mask, num_tokens: int) -> str | None:
    """What is wrong with a row's loss mask (None when nothing)."""
    if not isinstance(mask, list):
        return f"loss_mask is {_kind(mask)}; expected a list of 0/1"
    if len(mask) != num_tokens:
        return f"loss_mask has {len(mask)} entries for {num_tokens} tokens"
    for j, v in enumerate(mask):
        if type(v) not in (int, bool) or v not in (0, 1):
            return f"loss_mask[{j}] = {json.dumps(v)} is not 0 or 1"
    return None


def check_rollout(rollout, num_tokens: int) -> tuple[np.ndarray | None, str | None]:
    """A row's rollout logprobs as float64 ``[num_tokens]`` and what is wrong with them
    (None when nothing is; the server checks they are finite)."""
    kinds = (int, float)
    if not isinstance(rollout, list) or not all(
        isinstance(v, kinds) and not isinstance(v, bool) for v in rollout
    ):
        return None, f"rollout_logprobs is {_kind(rollout)}; expected a list of numbers"
    if len(rollout) != num_tokens:
        return None, f"rollout_logprobs has {len(rollout)} entries for {num_tokens} tokens"
    return np.asarray(rollout, dtype=np.float64), None


def _id_array(
    value, name: str, num_tokens: int, ndim: int, expected: str, dtype
) -> tuple[np.ndarray | None, str | None]:
    """A row's ``[num_tokens, ...]`` array of non-negative integer ids (``ndim`` axes) as
    ``dtype``, and what is wrong with it (None when nothing)."""
    if not isinstance(value, list):
        return None, f"{name} is {_kind(value)}; expected {expected}"
    try:
        values = np.asarray(value)
    except ValueError:  # ragged
        values = np.asarray([], dtype=object)
    if values.ndim != ndim or values.shape[0] != num_tokens or values.dtype.kind not in "iu":
        return None, f"{name} is not {expected}"
    if values.size and (values.min() < 0 or values.max() > np.iinfo(dtype).max):
        return None, f"{name}: {'expert ids' if ndim == 3 else 'ids'} must be integers >= 0"
    return values.astype(dtype), None


def check_routing(routing, num_tokens: int) -> tuple[np.ndarray | None, str | None]:
    """A row's routing as int32 ``[num_tokens, L, k]`` and what is wrong with it (None
    when nothing)."""
    expected = (
        f"[{num_tokens}][num_moe_layers][topk] lists of expert ids "
        "(one per token, all of the same size)"
    )
    return _id_array(routing, "routing", num_tokens, 3, expected, np.int32)


def check_target_ids(target_ids, num_tokens: int) -> tuple[np.ndarray | None, str | None]:
    """A row's target ids as int64 ``[num_tokens, K]`` and what is wrong with them (None
    when nothing is; the server checks them against its vocabulary and ``max_target_ids``)."""
    expected = f"[{num_tokens}][K] lists of token ids (the same K on every row)"
    return _id_array(target_ids, "target_ids", num_tokens, 2, expected, np.int64)


def read_rows(
    path: Path,
    limits: RowLimits,
    *,
    skip: Callable[[str], bool] = lambda key: False,
    tokenize: Callable[[str], list[int]] | None = None,
) -> Iterator[Row | BadRow]:
    """Reads ``path`` and yields, in order, each row as a :class:`Row` or a
    :class:`BadRow` (never raised).

    Args:
        path: the JSONL input.
        limits: what the model accepts.
        skip: called with each row's id :func:`key`; rows for which it returns True
            (already in the output) are passed over without checking their content.
        tokenize: turns the ``text`` of a row into token ids (None = no tokenizer:
            ``text`` rows are bad rows).

    Raises:
        OSError: the file cannot be read.
    """
    seen: set[str] = set()
    index = -1
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            index += 1
            try:
                value = json.loads(line)
            except ValueError as exc:
                yield BadRow(path, number, None, f"invalid JSON ({exc})")
                continue
            row_id = value.get("id", index) if isinstance(value, dict) else None
            row_id = index if isinstance(value, list) else row_id
            if row_id is not None:
                if key(row_id) in seen:
                    yield BadRow(path, number, row_id, f"duplicate id {json.dumps(row_id)}")
                    continue
                seen.add(key(row_id))
                if skip(key(row_id)):
                    continue
            try:
                ids, mask, inputs = _content(value, limits, tokenize)
            except ValueError as exc:
                yield BadRow(path, number, row_id, str(exc))
                continue
            yield Row(number, row_id, ids, mask, **inputs)


def _content(value, limits: RowLimits, tokenize):
    """The checked ``(token_ids, loss_mask, inputs)`` of a parsed line, ``inputs`` the
    row's arrays of :data:`_INPUTS` it carries, by name.

    Raises:
        ValueError: what is wrong with the row.
    """
    mask, given = None, {}
    if isinstance(value, list):
        ids = value
    elif isinstance(value, dict):
        mask = value.get("loss_mask")
        given = {name: value[name] for name in _INPUTS if value.get(name) is not None}
        if "token_ids" in value:
            ids = value["token_ids"]
        elif "text" in value:
            if not isinstance(value["text"], str):
                raise ValueError(f"text is {_kind(value['text'])}; expected a string")
            if tokenize is None:
                raise ValueError(
                    "a 'text' row needs a tokenizer: the server has none "
                    "(ModelInfo.has_tokenizer); pass --tokenizer DIR"
                )
            ids = list(tokenize(value["text"]))
        else:
            raise ValueError("missing 'token_ids' (or 'text')")
    else:
        raise ValueError(f"expected an object or a list of token ids, got {_kind(value)}")
    reason = check_token_ids(ids, limits)
    if reason is None and mask is not None:
        reason = check_loss_mask(mask, len(ids))
    inputs = {}
    for name, raw in given.items():
        if reason is None:
            inputs[name], reason = _INPUTS[name](raw, len(ids))
    if reason is not None:
        raise ValueError(reason)
    return ids, None if mask is None else [int(v) for v in mask], inputs


_INPUTS = {
    "routing": check_routing,
    "rollout_logprobs": check_rollout,
    "target_ids": check_target_ids,
}
"""The per-token inputs a row may carry besides ``loss_mask``, each with its check."""

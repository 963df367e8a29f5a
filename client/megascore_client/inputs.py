"""Turns what callers pass to ``score`` into flat numpy arrays, without importing torch.

Accepted batches:

* a list/tuple of sequences, each a list of ints, a 1-D numpy array, or anything
  array-like (torch / jax / cupy tensors via ``__array__`` or ``.tolist()``; a torch
  tensor on GPU is moved with ``.detach().cpu()``, found by duck typing);
* a 2-D array-like ``[B, W]``, optionally with ``lengths`` (``[B]``): row i is then its
  first ``lengths[i]`` entries (right padding is dropped).

Loss masks take the same forms (a 2-D mask is cut to the sequence lengths). A MoE
routing to replay is given per sequence, as ``ScoreResult.routing`` holds it: a list
with one integer ``[L_i, num_moe_layers, topk]`` array-like per sequence.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megascore.api.limits import score_from_problem
from megascore_client.errors import InvalidInputError

__all__ = ["Batch", "as_numpy", "make_batch"]

_INT32_MAX = np.iinfo(np.int32).max


def as_numpy(value) -> np.ndarray:
    """Converts an array-like to numpy by duck typing (never imports torch).

    Args:
        value: numpy array, list, or an object with ``__array__`` / ``tolist``. Objects
            with ``detach`` and ``cpu`` (torch tensors) are detached and moved to host.

    Returns:
        A numpy array (a view when ``value`` already is one).
    """
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu()
    array_like = isinstance(value, (list, tuple)) or any(
        hasattr(value, name) for name in ("__array__", "__array_interface__", "__buffer__")
    )
    if array_like:
        try:
            return np.asarray(value)
        except (TypeError, ValueError, RuntimeError):
            if not hasattr(value, "tolist"):
                raise
    if hasattr(value, "tolist"):
        return np.asarray(value.tolist())
    if hasattr(value, "__iter__") and not isinstance(value, (str, bytes, dict)):
        return np.asarray(list(value))
    return np.asarray(value)


@dataclasses.dataclass(frozen=True)
class Batch:
    """A batch in wire layout.

    Attributes:
        token_ids: int32 (when every id fits) or int64 ``[T]``, sequences concatenated.
        lengths: int64 ``[B]``, all >= 1.
        loss_mask: uint8 ``[T]`` of 0/1, or None (all ones).
        routing: int32 ``[T, num_moe_layers, topk]`` MoE routing to replay, or None.
        target_ids: int64 ``[T, K]`` ids whose logprobs to return at each token, or None.
        rollout_logprobs: float64 ``[T]`` the rollout engine's logprobs, or None.
        score_from: int64 ``[B]`` the first entry of each sequence whose outputs are
            returned, or None (0 for every sequence).
    """

    token_ids: np.ndarray
    lengths: np.ndarray
    loss_mask: np.ndarray | None = None
    routing: np.ndarray | None = None
    target_ids: np.ndarray | None = None
    rollout_logprobs: np.ndarray | None = None
    score_from: np.ndarray | None = None

    @property
    def num_target_ids(self) -> int:
        """K of the target ids (0 without)."""
        return 0 if self.target_ids is None else int(self.target_ids.shape[1])

    @property
    def offsets(self) -> np.ndarray:
        """int64 ``[B+1]``: sequence i is ``token_ids[offsets[i]:offsets[i+1]]``."""
        return np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])

    @property
    def num_sequences(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def per_token(self) -> dict[str, np.ndarray]:
        """The arrays with one row per token it carries, by ``ScoreRequest`` field name:
        ``token_ids`` and the per-token inputs given."""
        arrays = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: a for name, a in arrays.items() if name not in PER_SEQUENCE and a is not None}

    def per_sequence(self) -> dict[str, np.ndarray]:
        """The arrays with one value per sequence it carries besides ``lengths`` (the
        per-sequence inputs given), by ``ScoreRequest`` field name."""
        arrays = {name: getattr(self, name) for name in PER_SEQUENCE if name != "lengths"}
        return {name: a for name, a in arrays.items() if a is not None}

    def slice(self, start: int, stop: int) -> Batch:
        """Sequences ``[start, stop)`` as a new batch (array views, no copy)."""
        offsets = self.offsets
        lo, hi = int(offsets[start]), int(offsets[stop])
        rows = {name: values[lo:hi] for name, values in self.per_token().items()}
        rows.update({name: v[start:stop] for name, v in self.per_sequence().items()})
        return Batch(lengths=self.lengths[start:stop], **rows)


PER_SEQUENCE = ("lengths", "score_from")
"""The :class:`Batch` arrays with one value per sequence (the others: one row per token)."""


def _rows(obj, lengths, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Flattens a batch-like object into (values ``[T]``, lengths ``[B]``)."""
    if isinstance(obj, (str, bytes)):
        raise InvalidInputError(f"{what}: expected token sequences, got {type(obj).__name__}")
    if isinstance(obj, (list, tuple)):
        if lengths is not None:
            raise InvalidInputError("lengths is only accepted with a 2-D array of sequences")
        rows = []
        for i, item in enumerate(obj):
            arr = as_numpy(item)
            if arr.ndim != 1:
                raise InvalidInputError(
                    f"{what}[{i}]: expected a 1-D sequence, got shape {arr.shape} "
                    "(pass a list of sequences or a 2-D array)"
                )
            rows.append(arr)
        if not rows:
            raise InvalidInputError(f"{what}: at least one sequence is required")
        row_lengths = np.array([r.shape[0] for r in rows], dtype=np.int64)
        return np.concatenate(rows), row_lengths
    arr = as_numpy(obj)
    if arr.ndim != 2:
        raise InvalidInputError(
            f"{what}: expected a list of sequences or a 2-D array, got shape {arr.shape} "
            "(wrap a single sequence in a list)"
        )
    batch, width = arr.shape
    if batch == 0:
        raise InvalidInputError(f"{what}: at least one sequence is required")
    if lengths is None:
        return arr.reshape(-1), np.full(batch, width, dtype=np.int64)
    lengths = as_numpy(lengths).astype(np.int64, copy=False).reshape(-1)
    if lengths.shape[0] != batch:
        raise InvalidInputError(f"lengths has {lengths.shape[0]} entries for {batch} rows")
    if (lengths > width).any():
        i = int(np.argmax(lengths > width))
        raise InvalidInputError(f"lengths[{i}] = {lengths[i]} exceeds the row width {width}")
    keep = np.arange(width)[None, :] < lengths[:, None]
    return arr[keep], lengths


def _check_nonempty(lengths: np.ndarray, what: str) -> None:
    if (lengths < 1).any():
        i = int(np.argmax(lengths < 1))
        raise InvalidInputError(f"{what}[{i}]: empty sequence (every length must be >= 1)")


def _routing(routing, seq_lengths: np.ndarray) -> np.ndarray:
    """Checks a per-sequence routing and concatenates it: int32 ``[T, L, k]``."""
    if isinstance(routing, (str, bytes)) or not isinstance(routing, (list, tuple)):
        raise InvalidInputError(
            "routing: expected a list with one [length, num_moe_layers, topk] array per "
            f"sequence (as ScoreResult.routing), got {type(routing).__name__}"
        )
    if len(routing) != len(seq_lengths):
        raise InvalidInputError(
            f"routing: {len(routing)} routings for {len(seq_lengths)} sequences"
        )
    rows = [as_numpy(r) for r in routing]
    for i, (row, length) in enumerate(zip(rows, seq_lengths, strict=True)):
        if row.ndim != 3:
            raise InvalidInputError(
                f"routing[{i}]: shape {row.shape}, expected 3 dimensions "
                f"({length}, num_moe_layers, topk)"
            )
        if row.shape[0] != length:
            raise InvalidInputError(
                f"routing[{i}]: {row.shape[0]} rows for sequence {i} of {length} tokens "
                f"(shape {row.shape}, expected ({length}, num_moe_layers, topk))"
            )
        if row.shape[1:] != rows[0].shape[1:]:
            raise InvalidInputError(
                f"routing[{i}]: (num_moe_layers, topk) = {row.shape[1:]} differs from "
                f"routing[0]'s {rows[0].shape[1:]} (every sequence has the same layers and topk)"
            )
        if row.size and (row.dtype.kind not in "iu" or row.min() < 0 or row.max() > _INT32_MAX):
            raise InvalidInputError(f"routing[{i}]: expert ids must be integers >= 0")
    return np.concatenate(rows).astype(np.int32, copy=False)


def _per_sequence(values, seq_lengths: np.ndarray, what: str, ndim: int) -> np.ndarray:
    """Checks a list of one ``[L_i, ...]`` array per sequence (``ndim`` dims each, the
    same trailing shape) and concatenates it."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise InvalidInputError(
            f"{what}: expected a list with one array per sequence, got {type(values).__name__}"
        )
    if len(values) != len(seq_lengths):
        raise InvalidInputError(f"{what}: {len(values)} arrays for {len(seq_lengths)} sequences")
    rows = [as_numpy(v) for v in values]
    for i, (row, length) in enumerate(zip(rows, seq_lengths, strict=True)):
        if row.ndim != ndim or row.shape[0] != length or row.shape[1:] != rows[0].shape[1:]:
            raise InvalidInputError(
                f"{what}[{i}]: shape {row.shape}, expected {ndim} dimensions, "
                f"{length} rows (the sequence length), like {what}[0] {rows[0].shape}"
            )
    return np.concatenate(rows)


def _score_from(value, seq_lengths: np.ndarray) -> np.ndarray:
    """Checks ``score_from`` (one int for every sequence, or one per sequence): each an
    integer in ``[0, length]`` (:func:`megascore.api.limits.score_from_problem`); int64
    ``[B]``."""
    values = as_numpy(value)
    if values.ndim == 0:
        values = np.full(seq_lengths.shape, values)
    if values.shape != seq_lengths.shape:
        raise InvalidInputError(
            f"score_from: {values.size} values for {seq_lengths.size} sequences "
            "(give one int, or one per sequence)"
        )
    problem = score_from_problem(values, seq_lengths)  # the server's own rule
    if problem is not None:
        raise InvalidInputError(problem)
    return values.astype(np.int64)


def make_batch(
    sequences,
    loss_mask=None,
    lengths=None,
    routing=None,
    target_ids=None,
    rollout_logprobs=None,
    score_from=None,
) -> Batch:
    """Validates and flattens ``score`` arguments into a :class:`Batch`.

    Args:
        sequences: the batch (see the module docstring).
        loss_mask: optional 0/1 (or bool) mask with the same structure.
        lengths: optional ``[B]`` row lengths, only with a 2-D ``sequences``.
        routing: optional MoE routing to replay, one ``[L_i, num_moe_layers, topk]``
            integer array per sequence (the server checks the expert ids).
        target_ids: optional ids whose logprobs to return, one integer ``[L_i, K]``
            array per sequence (the server checks the ids).
        rollout_logprobs: optional rollout-engine logprobs, one float ``[L_i]`` array per
            sequence (entry 0 ignored; the server checks they are finite).
        score_from: optional first entry whose outputs are returned: one int for every
            sequence, or one per sequence, each in ``[0, length]``.

    Returns:
        The batch in wire layout.

    Raises:
        InvalidInputError: empty batch or sequence, non-integer or negative ids, a
            mask whose shape or values do not match, a ``score_from`` out of range.
    """
    ids, seq_lengths = _rows(sequences, lengths, "sequences")
    _check_nonempty(seq_lengths, "sequences")
    if ids.dtype.kind not in "iu":
        raise InvalidInputError(f"sequences: token ids must be integers, got dtype {ids.dtype}")
    routes = None if routing is None else _routing(routing, seq_lengths)
    if ids.size and ids.min() < 0:
        offsets = np.concatenate([[0], np.cumsum(seq_lengths)])
        seq = int(np.searchsorted(offsets, int(np.argmax(ids < 0)), side="right") - 1)
        raise InvalidInputError(f"sequences[{seq}]: negative token id")
    if ids.size and int(ids.max()) > _INT32_MAX:
        ids = ids.astype(np.int64, copy=False)
    else:
        ids = ids.astype(np.int32, copy=False)
    mask = None
    if loss_mask is not None:
        is_2d = not isinstance(loss_mask, (list, tuple)) and as_numpy(loss_mask).ndim == 2
        mask, mask_lengths = _rows(loss_mask, seq_lengths if is_2d else None, "loss_mask")
        if len(mask_lengths) != len(seq_lengths):
            raise InvalidInputError(
                f"loss_mask: {len(mask_lengths)} masks for {len(seq_lengths)} sequences"
            )
        if (mask_lengths != seq_lengths).any():
            i = int(np.argmax(mask_lengths != seq_lengths))
            raise InvalidInputError(
                f"loss_mask[{i}]: length {mask_lengths[i]} != sequence length {seq_lengths[i]}"
            )
        if mask.dtype.kind not in "biu" or not np.isin(mask, (0, 1)).all():
            raise InvalidInputError("loss_mask: values must be 0/1 (or bool)")
        mask = mask.astype(np.uint8, copy=False)
    targets = rollout = None
    if target_ids is not None:
        targets = _per_sequence(target_ids, seq_lengths, "target_ids", 2)
        if targets.dtype.kind not in "iu":
            raise InvalidInputError(f"target_ids: ids must be integers, got {targets.dtype}")
        targets = targets.astype(np.int64, copy=False)
    if rollout_logprobs is not None:
        rollout = _per_sequence(rollout_logprobs, seq_lengths, "rollout_logprobs", 1)
        if rollout.dtype.kind not in "fiu":
            raise InvalidInputError(f"rollout_logprobs: expected floats, got {rollout.dtype}")
        rollout = rollout.astype(np.float64, copy=False)
    return Batch(
        token_ids=ids,
        lengths=seq_lengths.astype(np.int64, copy=False),
        loss_mask=mask,
        routing=routes,
        target_ids=targets,
        rollout_logprobs=rollout,
        score_from=None if score_from is None else _score_from(score_from, seq_lengths),
    )

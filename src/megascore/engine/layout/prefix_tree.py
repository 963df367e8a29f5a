"""Shared prefixes of a step's sequences: which tokens a step computes once (numpy, torch-free).

A step computes *segments*, not sequences. Without sharing every sequence is one
segment (:func:`dense_layout`). With sharing (:func:`shared_layout`) sequences
that begin with the same tokens form a tree (a radix tree over the sequences,
exact match):

* every distinct shared prefix of at least ``min_shared`` tokens is one segment,
  computed once; a prefix nested in a longer shared prefix is a segment whose
  parent is the shorter one;
* a sequence's tokens after its deepest shared prefix are its own segment
  (a *continuation*), child of that prefix; a sequence that ends where a shared
  prefix ends (a prefix that is a whole sequence, identical sequences) has no
  segment of its own;
* a child segment starts with a copy of its parent's last token (the *lead row*),
  at the position that token has in the sequence: its output predicts the
  child's first token, so every prediction of a sequence comes from the row
  before the token in the same segment (as in a dense segment), and the parent's
  last row, whose next token differs per child, is used by none of them. A step
  that runs ``k`` MTP layers gives each child ``1 + k`` lead rows (the parent's
  last ``1 + k`` tokens): MTP depth ``d`` at position ``p`` reads the tokens up to
  ``p + d + 1``, so the rows whose MTP values depend on the child's tokens are
  computed in the child (:mod:`megascore.engine.outputs.step_metrics`);
* a segment's rows sit at positions ``offset ..`` of their sequences (RoPE and
  position ids continue from the prefix) and attend to the keys of the positions
  before their first row (the parent's, its ancestors'), and their own causal past
  (:mod:`megascore.model.attention`).

Only sequences of the same *label* (the engine uses the temperature) share
segments, and tokens match on every column of ``token_keys`` (the engine adds
the routes to replay: only tokens that replay the same routes are merged).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from megascore.api import layout

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SegmentLayout:
    """A microbatch's sequences as segments (see the module docstring).

    Attributes:
        token_ids: int64 ``[N]`` the segments' tokens, segment after segment.
        lengths: int64 ``[S]`` tokens per segment.
        parents: int64 ``[S]`` parent segment, -1 for a root (parents come first).
        offsets: int64 ``[S]`` position of each segment's first row in its sequences.
        sequences: int64 ``[S]`` one sequence (microbatch index) each segment belongs to.
        row_source: int64 ``[N]`` the flat token (microbatch index) each row computes.
        token_rows: int64 ``[T]`` the row that computes each flat token of the microbatch.
    """

    token_ids: np.ndarray
    lengths: np.ndarray
    parents: np.ndarray
    offsets: np.ndarray
    sequences: np.ndarray
    row_source: np.ndarray
    token_rows: np.ndarray

    @property
    def shared(self) -> bool:
        """Whether any segment continues another one or a cached prefix."""
        return bool((self.parents >= 0).any() or (self.offsets > 0).any())

    @property
    def rows_shared(self) -> bool:
        """Whether a row computes tokens of several sequences: a shared prefix, or
        identical sequences (which continue nothing: :attr:`shared` can be False)."""
        return bool(np.unique(self.token_rows).size < self.token_rows.size)


def dense_layout(
    token_ids: np.ndarray, lengths: np.ndarray, offsets: np.ndarray | None = None
) -> SegmentLayout:
    """Every sequence its own root segment (nothing shared).

    ``offsets`` (int64 ``[B]``, None: zeros): the position of each sequence's first token;
    the positions before it are a cached prefix (``megascore.engine.cache``), which the
    segment's rows attend to first."""
    lengths = np.asarray(lengths, dtype=np.int64)
    count = len(lengths)
    rows = np.arange(int(lengths.sum()), dtype=np.int64)
    return SegmentLayout(
        token_ids=np.asarray(token_ids, dtype=np.int64),
        lengths=lengths,
        parents=np.full(count, -1, dtype=np.int64),
        offsets=np.zeros(count, dtype=np.int64)
        if offsets is None
        else np.asarray(offsets, np.int64),
        sequences=np.arange(count, dtype=np.int64),
        row_source=rows,
        token_rows=rows,
    )


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Leading rows on which ``a`` and ``b`` ([n, w] token keys) agree."""
    n = min(len(a), len(b))
    differ = np.flatnonzero((a[:n] != b[:n]).any(axis=1))
    return int(differ[0]) if differ.size else n


def _sorted_with_lcp(
    token_keys: np.ndarray, lengths: np.ndarray, labels: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Sequences in lexicographic order (by label, then tokens) and the common prefix of
    each adjacent pair (0 across labels): ``(order [B], lcp [B-1])``."""
    bounds = layout.offsets(lengths)
    seq = [token_keys[bounds[b] : bounds[b + 1]] for b in range(len(lengths))]
    # empty sequences first; any total order on the tokens works: fixed-width keys as bytes
    order = sorted(range(len(lengths)), key=lambda b: (lengths[b] > 0, labels[b], seq[b].tobytes()))
    lcp = np.zeros(max(len(order) - 1, 0), dtype=np.int64)
    for i, (a, b) in enumerate(zip(order[:-1], order[1:], strict=True)):
        if labels[a] == labels[b]:
            lcp[i] = _common_prefix(seq[a], seq[b])
    return np.asarray(order, dtype=np.int64), lcp


def shared_groups(
    token_keys: np.ndarray, lengths: np.ndarray, labels: np.ndarray, min_shared: int
) -> list[np.ndarray]:
    """The step's sequences in groups that share a prefix of ``>= min_shared`` tokens.

    Groups share nothing with each other (a sequence alone is a group); a group is the
    unit a step keeps inside one microbatch.

    Args:
        token_keys: int64 ``[T, w]`` what must match for two tokens to be shared.
        lengths: int64 ``[B]``.
        labels: ``[B]`` sequences of different labels share nothing.
        min_shared: shortest prefix worth sharing (>= 1).

    Returns:
        Sequence indices per group; groups in order of their first sequence, each
        group's sequences in batch order.
    """
    order, lcp = _sorted_with_lcp(token_keys, lengths, labels)
    groups, start = [], 0
    for i in range(len(order)):
        if i == len(order) - 1 or lcp[i] < min_shared:
            groups.append(np.sort(order[start : i + 1]))
            start = i + 1
    return sorted(groups, key=lambda g: int(g[0]))


class _Builder:
    """Accumulates the segments of :func:`shared_layout`."""

    def __init__(self, token_ids: np.ndarray, lengths: np.ndarray, lead_rows: int):
        self.ids = token_ids
        self.lead_rows = lead_rows
        self.lengths = lengths
        self.bounds = layout.offsets(lengths)
        self.token_rows = np.full(int(self.bounds[-1]), -1, dtype=np.int64)
        self.segments: list[tuple[int, int, int, int]] = []  # (parent, offset, sequence, length)
        self.sources: list[np.ndarray] = []
        self.rows = 0

    def add(self, rep: int, start: int, end: int, parent: int, members) -> int:
        """Segment of tokens ``[start, end)`` of sequence ``rep`` (and of ``members``)."""
        base = int(self.bounds[rep])
        lead = 0 if parent < 0 else min(self.lead_rows, start)  # the parent's last tokens
        source = np.arange(base + start - lead, base + end, dtype=np.int64)
        own = np.arange(self.rows + lead, self.rows + lead + end - start, dtype=np.int64)
        for b in members:
            self.token_rows[self.bounds[b] + start : self.bounds[b] + end] = own
        self.segments.append((parent, start - lead, rep, len(source)))
        self.sources.append(source)
        self.rows += len(source)
        return len(self.segments) - 1

    def build(self, order, lcp, lo: int, hi: int, start: int, parent: int, min_shared: int):
        """Segments of the sorted sequences ``order[lo:hi]``, which share ``[0, start)``."""
        while lo < hi and self.lengths[order[lo]] == start:
            lo += 1  # ends with the parent (a prefix sorts first)
        i = lo
        while i < hi:
            j = i
            while j + 1 < hi and lcp[j] - start >= min_shared:
                j += 1
            if j == i:  # shares nothing more: a continuation (a root at start 0)
                b = int(order[i])
                self.add(b, start, int(self.lengths[b]), parent, [b])
            else:
                end = int(lcp[i:j].min())
                node = self.add(int(order[i]), start, end, parent, order[i : j + 1])
                self.build(order, lcp, i, j + 1, end, node, min_shared)
            i = j + 1

    def result(self) -> SegmentLayout:
        parent, offset, sequence, length = (
            np.asarray(col, dtype=np.int64).reshape(-1) for col in zip(*self.segments, strict=True)
        )
        source = np.concatenate(self.sources)
        assert (self.token_rows >= 0).all()
        return SegmentLayout(
            token_ids=self.ids[source],
            lengths=length,
            parents=parent,
            offsets=offset,
            sequences=sequence,
            row_source=source,
            token_rows=self.token_rows,
        )


def shared_layout(
    token_ids: np.ndarray,
    lengths: np.ndarray,
    *,
    min_shared: int,
    token_keys: np.ndarray | None = None,
    labels: np.ndarray | None = None,
    lead_rows: int = 1,
) -> SegmentLayout:
    """The segments of a microbatch with its shared prefixes computed once.

    Args:
        token_ids: int64 ``[T]`` the microbatch's tokens.
        lengths: int64 ``[B]`` its sequences' lengths (>= 0, not all 0).
        min_shared: shortest shared prefix (or nested extension of one) that becomes
            its own segment (>= 1).
        token_keys: int64 ``[T, w]`` what must match for tokens to be shared; None:
            the ids.
        labels: ``[B]`` sequences of different labels share nothing; None: all equal.
        lead_rows: the parent's last tokens a child computes again (>= 1; the module
            docstring).

    Returns:
        The :class:`SegmentLayout` (:func:`dense_layout`'s when nothing is shared).
    """
    if min_shared < 1 or lead_rows < 1:
        raise ValueError(f"min_shared and lead_rows must be >= 1, got {min_shared}, {lead_rows}")
    token_ids = np.asarray(token_ids, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    keys = token_ids[:, None] if token_keys is None else np.asarray(token_keys, dtype=np.int64)
    labels = np.zeros(len(lengths)) if labels is None else np.asarray(labels)
    order, lcp = _sorted_with_lcp(keys, lengths, labels)
    if len(lengths) < 2 or not (lcp >= min_shared).any():
        return dense_layout(token_ids, lengths)
    builder = _Builder(token_ids, lengths, lead_rows)
    empty = [int(b) for b in order if lengths[b] == 0]
    for b in empty:  # an empty sequence keeps its empty segment, as in the dense layout
        builder.add(b, 0, 0, -1, [b])
    builder.build(order, lcp, len(empty), len(order), 0, -1, min_shared)
    return builder.result()


def concat_layouts(parts: list[SegmentLayout], lengths: list[np.ndarray]) -> SegmentLayout:
    """One layout of several groups' layouts (their sequences concatenated in order).

    Args:
        parts: each group's layout.
        lengths: each group's sequence lengths.

    Returns:
        The layout of all their sequences, group after group.
    """
    rows = layout.offsets([len(p.token_ids) for p in parts])[:-1]
    segs = layout.offsets([len(p.lengths) for p in parts])[:-1]
    flat = layout.offsets([int(np.sum(n)) for n in lengths])[:-1]
    seqs = layout.offsets([len(n) for n in lengths])[:-1]

    def cat(values):
        return np.concatenate(list(values)).astype(np.int64)

    return SegmentLayout(
        token_ids=cat(p.token_ids for p in parts),
        lengths=cat(p.lengths for p in parts),
        parents=cat(
            np.where(p.parents >= 0, p.parents + s, -1) for p, s in zip(parts, segs, strict=True)
        ),
        offsets=cat(p.offsets for p in parts),
        sequences=cat(p.sequences + s for p, s in zip(parts, seqs, strict=True)),
        row_source=cat(p.row_source + f for p, f in zip(parts, flat, strict=True)),
        token_rows=cat(p.token_rows + r for p, r in zip(parts, rows, strict=True)),
    )

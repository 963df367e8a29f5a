"""How a step's sequences are cut into microbatches (before anything is packed).

:func:`split_microbatches` cuts contiguous runs of sequences balanced by padded tokens;
a microbatch is never shorter than the step's longest sequence (that would pad every
other microbatch up to it), so a step may use fewer microbatches than configured. With
prefix sharing the groups of sequences that share a prefix (:func:`shared_units`) are
the units that are cut, a group never cut apart (:func:`plan_microbatches`). A
data-parallel rank's share comes as a :class:`MicrobatchPlan`
(:mod:`megascore.engine.schedule.data_parallel`). Each microbatch is then packed by
:func:`megascore.engine.layout.microbatch.build_microbatch`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megascore.api import layout
from megascore.engine.layout.prefix_tree import (
    SegmentLayout,
    concat_layouts,
    dense_layout,
    shared_groups,
    shared_layout,
)


def split_microbatches(
    lengths: np.ndarray, pad_multiple: int, count: int
) -> tuple[list[tuple[int, int]], int]:
    """Splits a step's sequences into contiguous, balanced microbatches.

    Args:
        lengths: int64 ``[B]`` sequence lengths (>= 1).
        pad_multiple: per-sequence pad multiple.
        count: microbatches wanted.

    Returns:
        ``(ranges, pad_to)``: ``[first, end)`` sequence ranges in batch order (at most
        ``count``, each non-empty) and the packed length every microbatch is padded to
        (the longest microbatch's; a multiple of ``pad_multiple``).
    """
    padded = layout.padded_lengths(np.asarray(lengths), pad_multiple)
    total, longest = int(padded.sum()), int(padded.max())
    count = max(1, min(count, len(padded), total // longest))
    cum = np.cumsum(padded)
    cuts = [0]
    for k in range(1, count):
        # the sequence boundary closest to k / count of the tokens, after the previous cut
        cut = int(np.argmin(np.abs(cum - k * total / count))) + 1
        cut = min(max(cut, cuts[-1] + 1), len(padded) - (count - k))
        cuts.append(cut)
    cuts.append(len(padded))
    ranges = list(zip(cuts[:-1], cuts[1:], strict=True))
    pad_to = max(int(padded[a:b].sum()) for a, b in ranges)
    return ranges, pad_to


@dataclasses.dataclass(frozen=True)
class MicrobatchPlan:
    """How one rank cuts its sequences of a step into microbatches.

    Attributes:
        ranges: ``[first, end)`` sequence ranges in batch order, one per microbatch. An
            empty one (``first == end``) is a microbatch of ``pad_to`` pad tokens: a
            data-parallel rank without sequences in it still joins its peers' expert
            collectives (:mod:`megascore.engine.schedule.data_parallel`).
        pad_to: packed length of every microbatch.
        segments: None: every sequence computed whole; else each range's microbatch as
            its groups sharing a prefix are computed (:func:`shared_units`, laid out by
            the split, ``sequences`` numbered like ``ranges``).
    """

    ranges: list[tuple[int, int]]
    pad_to: int
    segments: list[MicrobatchSegments] | None = None

    @classmethod
    def split(cls, lengths: np.ndarray, pad_multiple: int, count: int) -> MicrobatchPlan:
        """The dense plan of a rank that runs its step alone (:func:`split_microbatches`)."""
        ranges, pad_to = split_microbatches(lengths, pad_multiple, count)
        return cls(ranges=ranges, pad_to=pad_to)


@dataclasses.dataclass(frozen=True)
class MicrobatchSegments:
    """Which sequences of a step one microbatch holds, and how they are computed.

    Attributes:
        sequences: int64 ``[B_mb]`` the step's sequences in the microbatch's order.
        segments: their :class:`~megascore.engine.layout.prefix_tree.SegmentLayout`.
    """

    sequences: np.ndarray
    segments: SegmentLayout


@dataclasses.dataclass(frozen=True)
class SharedUnits:
    """A step's sequences in groups that share a prefix: the units a step's microbatches
    (and data-parallel parts) are cut from, a group never cut apart.

    Attributes:
        groups: sequence indices per group
            (:func:`~megascore.engine.layout.prefix_tree.shared_groups`).
        layouts: each group's :class:`~megascore.engine.layout.prefix_tree.SegmentLayout`.
        costs: int64 ``[G]`` packed rows of each group's segments, padded.
    """

    groups: list[np.ndarray]
    layouts: list[SegmentLayout]
    costs: np.ndarray


def shared_units(
    token_ids: np.ndarray,
    lengths: np.ndarray,
    *,
    pad_multiple: int,
    min_shared: int,
    token_keys: np.ndarray | None = None,
    labels: np.ndarray | None = None,
    lead_rows: int = 1,
) -> SharedUnits:
    """The groups of a step's sequences that share a prefix of ``>= min_shared`` tokens,
    with their layouts (arguments as :func:`plan_microbatches`)."""
    token_ids = np.asarray(token_ids, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    keys = token_ids[:, None] if token_keys is None else token_keys
    labels = np.zeros(len(lengths)) if labels is None else labels
    groups = shared_groups(keys, lengths, labels, min_shared)
    layouts = []
    for seqs in groups:
        tok = layout.token_index(lengths, seqs)
        layouts.append(
            shared_layout(
                token_ids[tok],
                lengths[seqs],
                min_shared=min_shared,
                token_keys=keys[tok],
                labels=labels[seqs],
                lead_rows=lead_rows,
            )
        )
    costs = np.array(
        [layout.padded_lengths(g.lengths, pad_multiple).sum() for g in layouts], dtype=np.int64
    ).reshape(-1)
    return SharedUnits(groups, layouts, costs)


def joined_groups(units: SharedUnits, lengths: np.ndarray, which) -> MicrobatchSegments:
    """One microbatch of the groups ``which`` (indices into ``units``), in that order."""
    groups = [units.groups[g] for g in which]
    if not groups:  # a data-parallel rank's microbatch of pad tokens only
        empty = np.zeros(0, dtype=np.int64)
        return MicrobatchSegments(empty, dense_layout(empty, empty))
    return MicrobatchSegments(
        np.concatenate(groups),
        concat_layouts([units.layouts[g] for g in which], [lengths[g] for g in groups]),
    )


def plan_microbatches(
    token_ids: np.ndarray,
    lengths: np.ndarray,
    *,
    pad_multiple: int,
    count: int,
    min_shared: int | None = None,
    token_keys: np.ndarray | None = None,
    labels: np.ndarray | None = None,
    lead_rows: int = 1,
    cuts: MicrobatchPlan | None = None,
    offsets: np.ndarray | None = None,
) -> tuple[list[MicrobatchSegments], int]:
    """Splits a step into microbatches, computing shared prefixes once when asked.

    Dense (``min_shared`` None): :func:`split_microbatches` of the sequences in batch
    order. Shared: the sequences that share a prefix (:func:`shared_units`) stay in one
    microbatch; groups are split like sequences, by what their segments occupy. Given
    ``cuts`` (a data-parallel rank's share), its ranges are the microbatches, dense or
    laid out shared by the split.

    Args:
        token_ids: int64 ``[T]`` the step's tokens.
        lengths: int64 ``[B]``.
        pad_multiple: per-segment pad multiple.
        count: microbatches wanted.
        min_shared: shortest prefix worth sharing, or None for the dense layout.
        token_keys: int64 ``[T, w]`` what must match for tokens to be shared (None: ids).
        labels: ``[B]`` sequences of different labels share nothing (None: all equal).
        lead_rows: the parent's last tokens a continuation computes again
            (:func:`~megascore.engine.layout.prefix_tree.shared_layout`).
        cuts: the step's given microbatches (:mod:`megascore.engine.schedule.data_parallel`,
            whose ``segments`` replace ``min_shared``); None: cut here.
        offsets: int64 ``[B]`` the position of each sequence's first token (dense only:
            the tokens before it are read from the prefix cache); None: zeros.

    Returns:
        ``(plans, pad_to)``: the microbatches in order and their common packed length.
    """
    token_ids = np.asarray(token_ids, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if cuts is None and min_shared is not None:
        units = shared_units(
            token_ids,
            lengths,
            pad_multiple=pad_multiple,
            min_shared=min_shared,
            token_keys=token_keys,
            labels=labels,
            lead_rows=lead_rows,
        )
        ranges, pad_to = split_microbatches(units.costs, pad_multiple, count)
        return [joined_groups(units, lengths, range(a, b)) for a, b in ranges], pad_to
    cuts = cuts or MicrobatchPlan.split(lengths, pad_multiple, count)
    if cuts.segments is not None:
        return list(cuts.segments), cuts.pad_to
    plans = []
    for a, b in cuts.ranges:
        seqs = np.arange(a, b, dtype=np.int64)
        tokens = token_ids[layout.token_index(lengths, seqs)]
        starts = None if offsets is None else np.asarray(offsets, np.int64)[seqs]
        plans.append(MicrobatchSegments(seqs, dense_layout(tokens, lengths[seqs], starts)))
    return plans, cuts.pad_to

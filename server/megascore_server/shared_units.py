"""Planning units: the sequences of a request that share a prompt go to one step together.

With prefix sharing on, a step computes every prefix its sequences share once
(``megascore.engine.layout.prefix_tree``), so what a step costs is the rows its segments
occupy, not its sequences' dense lengths. The batcher therefore plans in *units*: a
unit is a set of a request's sequences that share a prefix of at least the engine's
``min_shared_prefix`` tokens (at the same temperature), costed as the rows the engine
computes for it alone in a step: its segments as the engine's prefix tree cuts them
(``megascore.engine.layout.prefix_tree``: each shared prefix and nested extension once, each
continuation with its lead row), each padded to the per-sequence pad multiple, e.g.
``pad(P) + sum_i pad(L_i - P + 1)`` for one prompt of ``P`` tokens. Sequences of other
requests in the step may share more, never less. Every other sequence is a unit of its
own at its padded length.

A unit larger than the step budget is cut where its members share least (a system
prompt shared by several prompt groups: into the groups); a group that alone exceeds
the budget is cut into consecutive runs of members that fit, each run computing the
prompt once in its own step. A request with MoE / MTP metrics is planned alike, its
continuations costed with the engine's ``metrics_lead_rows`` (1 + its MTP layers), or
sequence by sequence where its metrics steps run dense. Requests with routes to replay
or target ids and a replica without sharing plan sequence by sequence, as before. With
the engine's prefix cache, a unit costs what its members do not find cached
(:meth:`Sharing.units`): the uncached tails, as the engine computes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from megascore.api.layout import offsets, padded_lengths
from megascore.api.types import ScoreBatch


@dataclasses.dataclass(frozen=True)
class Sharing:
    """What an engine's steps share, for the plan.

    Attributes:
        min_shared_prefix: the shortest prefix its steps share (0: they run dense).
        metrics_lead_rows: rows a continuation repeats of its prefix in a step with MoE /
            MTP metrics (0: such steps run dense).
        cached: ``batch -> int64 [B]`` the tokens of each sequence the engine's prefix
            cache holds now (``DistributedEngine.cached_prefix_tokens``; None: no cache).
    """

    min_shared_prefix: int = 0
    metrics_lead_rows: int = 0
    cached: Callable[[ScoreBatch], np.ndarray | None] | None = None

    @classmethod
    def of(cls, engine) -> Sharing:
        """An engine's (``DistributedEngine.min_shared_prefix``, ``metrics_lead_rows`` and
        ``cached_prefix_tokens``; an engine without them runs dense, without a cache)."""
        return cls(
            getattr(engine, "min_shared_prefix", None) or 0,
            getattr(engine, "metrics_lead_rows", None) or 0,
            getattr(engine, "cached_prefix_tokens", None),
        )

    def units(self, batch: ScoreBatch, pad_multiple: int, budget: int):
        """:func:`planning_units` of ``batch`` for this engine, each unit's cost less the
        tokens its members all find in the prefix cache (the engine computes the
        uncached tails only)."""
        units, costs = planning_units(
            batch, pad_multiple, self.min_shared_prefix, budget, self.metrics_lead_rows
        )
        cached = None if self.cached is None else self.cached(batch)
        if cached is not None and cached.any():
            saved = np.array([int(cached[members].min()) for members in units], np.int64)
            costs = np.maximum(costs - saved, pad_multiple)
        return units, costs


def planning_units(
    batch: ScoreBatch,
    pad_multiple: int,
    min_shared_prefix: int,
    budget: int,
    metrics_lead_rows: int = 0,
) -> tuple[list[np.ndarray], np.ndarray]:
    """The units of a request and their costs in rows.

    Args:
        batch: the request.
        pad_multiple: the engine's per-sequence pad multiple.
        min_shared_prefix: the shortest prefix the engine shares; 0 when it shares none.
        budget: the step budget (rows); every sequence alone fits it.
        metrics_lead_rows: rows a continuation repeats in a step with MoE / MTP metrics;
            0 when such steps run dense.

    Returns:
        ``(units, costs)``: int64 arrays of request-sequence indices (ascending), and
        int64 ``[num_units]`` rows each unit costs a step.
    """
    padded = padded_lengths(batch.lengths, pad_multiple)
    lead = metrics_lead_rows if batch.return_moe_metrics or batch.return_mtp_metrics else 1
    dense = batch.routing is not None or batch.target_ids is not None or not lead
    if not min_shared_prefix or dense:
        return [np.array([i]) for i in range(padded.size)], padded
    planner = _Planner(batch, pad_multiple, min_shared_prefix, budget, lead)
    units = [unit for run in planner.runs() for unit in planner.fit(*run)]
    costs = np.array([planner.cost(*unit) for unit in units], dtype=np.int64)
    return [np.sort(members) for members, _ in units], costs


class _Planner:
    """The units of one request (see the module docstring)."""

    def __init__(
        self, batch: ScoreBatch, pad_multiple: int, min_shared: int, budget: int, lead: int
    ):
        self.ids = np.asarray(batch.token_ids)
        self.lengths = np.asarray(batch.lengths, dtype=np.int64)
        self.temperatures = batch.temperatures()
        self.starts = offsets(self.lengths)[:-1]
        self.pad = pad_multiple
        self.min_shared = min_shared
        self.budget = budget
        self.lead = lead

    def _tokens(self, i: int) -> np.ndarray:
        return self.ids[self.starts[i] : self.starts[i] + self.lengths[i]]

    def _common(self, a: int, b: int) -> int:
        x, y = self._tokens(a), self._tokens(b)
        n = min(x.size, y.size)
        differ = np.flatnonzero(x[:n] != y[:n])
        return int(differ[0]) if differ.size else n

    def runs(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Sequences in token order (those with a common prefix are neighbours), cut
        where two neighbours share less than ``min_shared``: ``(members, links)``,
        ``links[j]`` the prefix members ``j`` and ``j + 1`` share."""
        # by temperature, then tokens (fixed-width keys as bytes: a prefix sorts first)
        key = self.temperatures
        order = sorted(range(self.lengths.size), key=lambda i: (key[i], self._tokens(i).tobytes()))
        links = np.array(
            [
                self._common(a, b) if key[a] == key[b] else 0  # no sharing across them
                for a, b in zip(order, order[1:], strict=False)
            ],
            np.int64,
        )
        cuts = np.flatnonzero(links < self.min_shared) + 1
        bounds = [0, *cuts.tolist(), len(order)]
        return [
            (np.array(order[s:e], np.int64), links[s : e - 1])
            for s, e in zip(bounds, bounds[1:], strict=False)
        ]

    def cost(self, members: np.ndarray, links: np.ndarray) -> int:
        """Padded rows of ``members`` (neighbours in sorted order, ``links`` between
        them) alone in a step: the segments the engine's prefix tree cuts them into."""
        segments: list[int] = []
        self._segments(self.lengths[members], links, 0, members.size, 0, segments)
        return int(padded_lengths(np.array(segments, np.int64), self.pad).sum())

    def _segments(self, lengths, links, lo: int, hi: int, start: int, out: list) -> None:
        """Segment lengths of the sorted sequences ``[lo, hi)`` sharing ``[0, start)``,
        as ``megascore.engine.layout.prefix_tree`` cuts them (a child's lead rows counted)."""
        lead = min(self.lead, start)
        while lo < hi and lengths[lo] == start:
            lo += 1  # it ends with its parent (a prefix sorts first): no segment
        i = lo
        while i < hi:
            j = i
            while j + 1 < hi and links[j] - start >= self.min_shared:
                j += 1
            if j == i:  # shares nothing more: a continuation (or a sequence alone)
                out.append(int(lengths[i]) - start + lead)
            else:
                end = int(links[i:j].min())
                out.append(end - start + lead)
                self._segments(lengths, links, i, j + 1, end, out)
            i = j + 1

    def fit(self, members: np.ndarray, links: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """``members`` as units ``(members, links)`` within the budget: whole when they
        fit, else cut at their weakest links (recursively), else into consecutive runs
        of members that fit."""
        if members.size == 1 or self.cost(members, links) <= self.budget:
            return [(members, links)]
        weakest = int(links.min())
        cuts = np.flatnonzero(links == weakest) + 1
        if cuts.size < links.size:  # some links are stronger: cut at the weak ones
            bounds = [0, *cuts.tolist(), members.size]
            return [
                unit
                for s, e in zip(bounds, bounds[1:], strict=False)
                for unit in self.fit(members[s:e], links[s : e - 1])
            ]
        units, start = [], 0
        for end in range(2, members.size + 1):  # one group over the budget: runs that fit
            if self.cost(members[start:end], links[start : end - 1]) > self.budget:
                units.append((members[start : end - 1], links[start : end - 2]))
                start = end - 1
        units.append((members[start:], links[start:]))
        return units

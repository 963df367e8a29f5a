"""Planning units: the sequences of a request that share a prompt go to one step together.

With prefix sharing on, a step computes every prefix its sequences share once
(``megascore.engine.prefix_tree``), so what a step costs is the rows its segments
occupy, not its sequences' dense lengths. The batcher therefore plans in *units*: a
unit is a set of a request's sequences that share a prefix of at least the engine's
``min_shared_prefix`` tokens, costed as the rows the engine computes for it

    pad(P) + sum over members of pad(L_i - P + 1)   (0 for a member that is the prefix)

(``P`` the prefix they all share, ``+ 1`` the lead row of a continuation, ``pad`` the
per-sequence pad multiple). Nested prefixes (a system prompt under several prompts)
make the engine share more than ``P``: the cost is an upper bound, never below what
the step really computes. Every other sequence is a unit of its own at its padded
length.

A unit larger than the step budget is cut where its members share least (a system
prompt shared by several prompt groups: into the groups); a group that alone exceeds
the budget is cut into consecutive runs of members that fit, each run computing the
prompt once in its own step. Requests the engine does not share (routes to replay,
target ids, MoE / MTP metrics) or a replica without sharing plan sequence by sequence,
as before.
"""

from __future__ import annotations

import numpy as np

from megascore.api.layout import offsets, padded_lengths
from megascore.api.types import ScoreBatch


def planning_units(
    batch: ScoreBatch, pad_multiple: int, min_shared_prefix: int, budget: int
) -> tuple[list[np.ndarray], np.ndarray]:
    """The units of a request and their costs in rows.

    Args:
        batch: the request.
        pad_multiple: the engine's per-sequence pad multiple.
        min_shared_prefix: the shortest prefix the engine shares; 0 when it shares none.
        budget: the step budget (rows); every sequence alone fits it.

    Returns:
        ``(units, costs)``: int64 arrays of request-sequence indices (ascending), and
        int64 ``[num_units]`` rows each unit costs a step.
    """
    padded = padded_lengths(batch.lengths, pad_multiple)
    dense = batch.routing is not None or batch.target_ids is not None
    if not min_shared_prefix or dense or batch.return_moe_metrics or batch.return_mtp_metrics:
        return [np.array([i]) for i in range(padded.size)], padded
    planner = _Planner(batch, pad_multiple, min_shared_prefix, budget)
    units = [unit for run in planner.runs() for unit in planner.fit(*run)]
    costs = np.array([planner.cost(*unit) for unit in units], dtype=np.int64)
    return [np.sort(members) for members, _ in units], costs


class _Planner:
    """The units of one request (see the module docstring)."""

    def __init__(self, batch: ScoreBatch, pad_multiple: int, min_shared: int, budget: int):
        self.ids = np.asarray(batch.token_ids)
        self.lengths = np.asarray(batch.lengths, dtype=np.int64)
        self.starts = offsets(self.lengths)[:-1]
        self.pad = pad_multiple
        self.min_shared = min_shared
        self.budget = budget

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
        order = sorted(range(self.lengths.size), key=lambda i: self._tokens(i).tobytes())
        links = np.array(
            [self._common(a, b) for a, b in zip(order, order[1:], strict=False)],
            np.int64,
        )
        cuts = np.flatnonzero(links < self.min_shared) + 1
        bounds = [0, *cuts.tolist(), len(order)]
        return [
            (np.array(order[s:e], np.int64), links[s : e - 1])
            for s, e in zip(bounds, bounds[1:], strict=False)
        ]

    def cost(self, members: np.ndarray, links: np.ndarray) -> int:
        """Rows of ``members`` (neighbours in token order, ``links`` between them) in
        one step; their padded length when alone."""
        if members.size == 1:
            return int(padded_lengths(self.lengths[members], self.pad)[0])
        prefix = int(links.min())
        rest = self.lengths[members] - prefix
        rows = np.where(rest > 0, padded_lengths(np.maximum(rest, 0) + 1, self.pad), 0)
        return int(padded_lengths(np.array([prefix]), self.pad)[0] + rows.sum())

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

"""Work items of the batcher: a request being scored piecewise, and a barrier.

A :class:`PendingRequest` tracks which of its planning units (sequences, or
sequences sharing a prompt: :mod:`megascore_server.shared_units`) still wait, collects
the pieces of output each engine step produced for it and, once every
sequence was scored, assembles its :class:`TimedOutput` in its own order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

import numpy as np

from megascore.api import schema
from megascore.api.metric_sums import MetricSums
from megascore.api.selection import concat_outputs, keep_masked_positions, select_sequences
from megascore.api.types import ModelInfo, ScoreBatch, ScoreOutput
from megascore_server.shared_units import Sharing

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TimedOutput:
    """A request's output with its server-side timings."""

    output: ScoreOutput
    queue_ms: float
    compute_ms: float
    num_steps: int


@dataclasses.dataclass(eq=False)
class Barrier:
    """A call that runs on the engine thread once everything queued before it is done."""

    fn: Callable[[], object]
    future: asyncio.Future


@dataclasses.dataclass(eq=False)
class PendingRequest:
    """One validated request inside the batcher.

    ``solo`` requests (MoE / MTP metrics) never share a step; their metrics are
    formed once from the sums of the steps that scored them
    (:class:`megascore.api.metric_sums.MetricSums`: the request's metrics whatever its
    steps), or, from an engine that reports no sums (``metrics_reduction``
    "microbatch"), the token-weighted mean of the steps' values. Requests that replay a
    MoE routing (``replays``) share steps only with each other: a step replays the
    routing of all its tokens or of none. Requests share a step only within one
    ``group``: the same weight sets (the ``base`` set of ``model``, ``reference``; a step
    never mixes sets, so a set is swapped in once per step, not per request) and the same
    ``replays``. LoRA adapters over one set and the set itself share steps
    (:func:`step_pieces`).
    """

    request_id: str
    batch: ScoreBatch
    future: asyncio.Future
    arrival: float
    deadline: float | None
    units: list[np.ndarray]
    """Request-sequence indices planned together (:mod:`megascore_server.shared_units`)."""
    costs: np.ndarray
    """Rows each unit costs a step."""
    remaining: np.ndarray
    """Units not yet dispatched, costliest first."""
    remaining_tokens: int
    parts: list[tuple[np.ndarray, ScoreOutput]] = dataclasses.field(default_factory=list)
    metric_sums: MetricSums | None = None
    """The steps' metric sums added up (an engine that reports them)."""
    metric_means: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    """Otherwise the steps' metrics, weighted by their tokens, added up."""
    metric_tokens: int = 0
    steps_computing_all: int = 0
    """Steps of this request that computed every position (a mixed step, see result())."""
    first_start: float | None = None
    compute_s: float = 0.0
    num_steps: int = 0
    base: str = ""
    """The weight set ``model`` runs on (an adapter's set; "": ``model`` itself)."""
    model_version: str = ""
    """The version of ``model`` when a step ran it over its base (:func:`step_pieces`)."""

    @classmethod
    def create(
        cls,
        request_id: str,
        batch: ScoreBatch,
        *,
        arrival: float,
        deadline: float | None,
        pad_multiple: int,
        sharing: Sharing,
        budget: int,
        base: str = "",
    ) -> PendingRequest:
        units, costs = sharing.units(batch, pad_multiple, budget)
        return cls(
            base=base,
            request_id=request_id,
            batch=batch,
            future=asyncio.get_running_loop().create_future(),
            arrival=arrival,
            deadline=deadline,
            units=units,
            costs=costs,
            remaining=np.argsort(-costs, kind="stable"),
            remaining_tokens=batch.num_tokens,
        )

    @property
    def solo(self) -> bool:
        return self.batch.return_moe_metrics or self.batch.return_mtp_metrics

    @property
    def replays(self) -> bool:
        return self.batch.routing is not None

    @property
    def group(self) -> tuple[str, str, bool]:
        """What the requests of one step share (the class docstring)."""
        return self.base or self.batch.model, self.batch.reference, self.replays

    def dropped(self, now: float) -> bool:
        """Cancelled by its caller, answered already, or past its deadline."""
        return self.future.done() or (self.deadline is not None and now >= self.deadline)

    def remaining_costs(self) -> np.ndarray:
        """Rows of the waiting units, costliest first."""
        return self.costs[self.remaining]

    def take(self, positions: np.ndarray) -> tuple[np.ndarray, int]:
        """Removes ``remaining[positions]`` from the waiting units.

        Returns:
            ``(request-sequence indices ascending, their real token count)``.
        """
        idx = np.sort(np.concatenate([self.units[u] for u in self.remaining[positions]]))
        keep = np.ones(self.remaining.size, dtype=bool)
        keep[positions] = False
        self.remaining = self.remaining[keep]
        tokens = int(self.batch.lengths[idx].sum())
        self.remaining_tokens -= tokens
        return idx, tokens

    def record_step(
        self,
        step: ScoreBatch,
        output: ScoreOutput,
        step_idx: np.ndarray,
        idx: np.ndarray,
        elapsed: float,
    ) -> None:
        """Keeps this request's part of a step's output.

        Args:
            step: the merged batch of the step.
            output: the step's output.
            step_idx: where this request's sequences sit in the step.
            idx: which request sequences those are.
            elapsed: seconds the step took.
        """
        self.compute_s += elapsed
        self.num_steps += 1
        if self.future.done():
            return
        part = select_sequences(output, step.lengths, step_idx, self.batch)
        if step.model != self.batch.model:  # an adapter's request in a step over its set
            part.weights_version = self.model_version
        self.parts.append((idx, part))
        self.steps_computing_all += step.logprob_positions != schema.MASKED
        if self.solo and output.metric_sums is not None:
            sums = output.metric_sums
            self.metric_sums = sums if self.metric_sums is None else self.metric_sums + sums
        elif self.solo:
            for kind in ("moe", "mtp"):
                sums = self.metric_means.setdefault(kind, {})
                for name, value in getattr(output, f"{kind}_metrics").items():
                    sums[name] = sums.get(name, 0.0) + float(value) * step.num_tokens
            self.metric_tokens += step.num_tokens

    def result(self) -> TimedOutput:
        """The assembled result (every sequence must have been recorded)."""
        output = concat_outputs(self.parts, self.batch.lengths)
        if self.batch.logprob_positions == schema.MASKED and self.steps_computing_all:
            # a masked step's output holds its fill outside the mask already (finish_step)
            keep_masked_positions(output.values, self.batch.lengths, self.batch.loss_mask)
        output.weights_version = self.parts[-1][1].weights_version
        if self.metric_sums is not None:
            output.moe_metrics, output.mtp_metrics = self.metric_sums.values()
        elif self.solo and self.metric_tokens:
            for kind, sums in self.metric_means.items():
                means = {name: value / self.metric_tokens for name, value in sums.items()}
                setattr(output, f"{kind}_metrics", means)
        return TimedOutput(
            output=output,
            queue_ms=(self.first_start - self.arrival) * 1000.0,
            compute_ms=self.compute_s * 1000.0,
            num_steps=self.num_steps,
        )


def step_pieces(pieces: list, info: Callable[[], ModelInfo]) -> list[tuple[ScoreBatch, np.ndarray]]:
    """The ``(batch, sequence indices)`` a step merges from ``(PendingRequest, indices)``
    of one group: as they came when they name one model; else (LoRA adapters over one
    weight set, and the set) each over the set: ``model`` the set, its sequences' adapter
    slot in the input ``adapter`` (the engine's ``ServedModel.slot`` now, from ``info()``),
    its pin checked already (the batcher's ``_pinned_to_served``)."""
    if len({item.batch.model for item, _ in pieces}) == 1:
        return [(item.batch, idx) for item, idx in pieces]
    served, out = info(), []
    for item, idx in pieces:
        entry = served.served(item.batch.model)
        item.model_version = entry.weights_version
        rows = np.full(item.batch.num_sequences, entry.slot, dtype=np.int64)
        over = dict(model=item.base or item.batch.model, weights_version="", adapter=rows)
        out.append((dataclasses.replace(item.batch, **over), idx))
    return out

"""The output rank's end of a step: the gathered packed results as a
:class:`~megascore.api.types.ScoreOutput` (local work only).

:func:`finish_step` maps every per-token head output from packed to flat through the
packed <-> flat index that packing built (:class:`PredictionIndex`, from
``token_positions``) and the recorded routes to each token; every other output (the
losses, their token counts, the routing, the mismatch statistics) is its table entry's
``finish``. The step itself is :func:`megascore.engine.schedule.step.run_step`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from megascore.api import layout, schema
from megascore.api.finish import finish_values
from megascore.api.types import ScoreBatch, ScoreOutput
from megascore.engine.schedule.step import StepResult


@dataclasses.dataclass(frozen=True)
class PredictionIndex:
    """The packed -> flat index of a step's per-token results, built once per step.

    Position ``p`` of a padded segment holds the prediction of token ``p + 1``; in
    the output, entry ``t`` of a sequence holds the prediction of token ``t`` and
    entry 0 (no prediction) holds a fill value.

    Attributes:
        source: int64 ``[T]`` packed position that predicts each token of the batch
            (meaningless at the first entries, which are filled).
        first: int64 ``[B]`` flat index of each sequence's entry 0.
    """

    source: np.ndarray
    first: np.ndarray

    @classmethod
    def build(cls, token_positions: torch.Tensor, lengths: np.ndarray) -> PredictionIndex:
        """From the packed position of every token and the batch's lengths."""
        return cls(source=token_positions.numpy() - 1, first=layout.offsets(lengths)[:-1])

    def to_flat(self, packed: torch.Tensor | None, fill: float) -> np.ndarray | None:
        """``[T_padded, ...]`` packed results -> ``[T, ...]`` flat (same dtype), or None."""
        if packed is None:
            return None
        flat = packed.numpy()[self.source]
        flat[self.first] = fill
        return flat


def finish_step(batch: ScoreBatch, result: StepResult) -> ScoreOutput:
    """Output rank: builds the :class:`ScoreOutput` from the gathered step results.

    Every per-token head output is mapped from packed to flat (its ``fill`` at entry 0 of
    each sequence), the recorded routes to their tokens; then each wanted output with
    a ``finish`` (:data:`megascore.api.schema.OUTPUTS`) is computed from those.

    Args:
        batch: the batch of the step.
        result: the output rank's :class:`StepResult`.

    Returns:
        The output in the batch's flat token layout (``weights_version`` left empty).
    """
    index = PredictionIndex.build(result.token_positions, batch.lengths)
    values = {}
    for name, packed in result.values.items():
        out = schema.output(name)
        flat = schema.at_last_row(out)  # [B, *dims] already
        values[name] = packed.numpy() if flat else index.to_flat(packed, out.fill)
    if batch.return_routing and batch.routing is None:  # recorded: each token's routes
        values["routing"] = result.routing.numpy()[result.token_positions.numpy()].astype(np.int32)
    return ScoreOutput(
        values=finish_values(batch, values),
        moe_metrics=result.moe_metrics if batch.return_moe_metrics else {},
        mtp_metrics=result.mtp_metrics if batch.return_mtp_metrics else {},
        metric_sums=result.metric_sums,
    )

"""The sums a step's MoE / MTP metrics are formed from (``metrics_reduction="step"``).

:mod:`megascore.engine.outputs.step_metrics` collects them over a step's tokens and reduces
them over the ranks (float64). Each is a sum over the step's tokens or sequences, so
the sums of steps that score different sequences of one request add up to the
request's: :meth:`MetricSums.values` applied to that total gives the metrics of the
request as one step would, whatever steps the batcher cut it into. (The metrics
themselves do not add: ``load_balancing_loss`` is quadratic in the token counts and
an acceptance rate is a ratio, so a mean of the steps' values depends on the cut, and
a request whose shared prefixes make it fit in fewer steps would read differently
from the same request scored dense.) Counts (tokens, accepted and counted MTP
tokens) are whole numbers in float64, exact up to 2^53.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class MetricSums:
    """One step's (or several steps') metric sums, the same on every rank.

    Attributes:
        tokens: float64 ``[layers, 2E + 2]`` per MoE tracker slot (decoder layers, then
            MTP layers): tokens routed to each of the ``E`` experts (the aux-loss top-k),
            their summed routing scores per expert, real tokens, summed squared
            ``logsumexp`` of the router logits.
        sequences: float64 ``[2, layers]`` per slot: the per-sequence aux losses summed
            over the sequences, and how many sequences had a token there.
        mtp: float64 ``[3, mtp_layers]`` per MTP layer: summed token losses, accepted
            tokens, counted tokens.
        topk: the router's top-k.
        moe_layers: Megatron's count of MoE layers (the mean over layers divides by it).
        moe_names: the MoE metrics to report.
        want_mtp: report the MTP metrics.
    """

    tokens: np.ndarray
    sequences: np.ndarray
    mtp: np.ndarray
    topk: int
    moe_layers: int
    moe_names: tuple[str, ...]
    want_mtp: bool

    def __add__(self, other: MetricSums) -> MetricSums:
        return dataclasses.replace(
            self,
            tokens=self.tokens + other.tokens,
            sequences=self.sequences + other.sequences,
            mtp=self.mtp + other.mtp,
        )

    def values(self) -> tuple[dict[str, float], dict[str, float]]:
        """``(moe, mtp)`` metric name -> value: Megatron's formulas applied to the sums
        (docs/engine.md, "MoE and MTP metrics")."""
        E = (self.tokens.shape[1] - 2) // 2
        counts, scores = self.tokens[:, :E], self.tokens[:, E : 2 * E]
        n, lse2 = self.tokens[:, 2 * E], self.tokens[:, 2 * E + 1]
        n_safe = np.maximum(n, 1.0)  # a layer without real tokens adds 0
        aux = (counts * scores).sum(-1) * E / (self.topk * n_safe**2)
        per_layer = {
            "load_balancing_loss": aux,
            "global_load_balancing_loss": aux,
            "seq_load_balancing_loss": self.sequences[0] / np.maximum(self.sequences[1], 1.0),
            "z_loss": lse2 / n_safe,
        }
        moe = {name: float(per_layer[name].sum() / self.moe_layers) for name in self.moe_names}
        mtp = {}
        if self.want_mtp:
            loss, correct, total = self.mtp
            for i, counted in enumerate(np.maximum(total, 1.0)):
                mtp[f"mtp_{i + 1}_loss"] = float(loss[i] / counted)
                mtp[f"mtp_{i + 1}_acceptance_rate"] = float(correct[i] / counted * 100.0)
        return moe, mtp

"""The outputs of the table computed on the output rank from the head's, in the flat token
layout (numpy, torch-free): every wanted ``finish`` (losses, counts, mismatch statistics,
...), then the fills of ``logprob_positions`` / ``score_from``. Run by
``megascore.engine.schedule.step_output`` after a step, and by the prefix cache's planner
(``megascore.engine.cache.planner``) on the whole sequences it joins."""

from __future__ import annotations

from megascore.api import schema, selection
from megascore.api.types import ScoreBatch


def finish_values(batch: ScoreBatch, values: dict) -> dict:
    """The outputs of the table computed from the head's (``values``, flat, in place):
    every wanted ``finish``, then the fills of ``logprob_positions`` / ``score_from``."""
    for out in schema.OUTPUTS:
        if out.finish is not None and out.wanted(batch):
            values[out.name] = out.finish(batch, values)
    if batch.logprob_positions == schema.MASKED:  # e.g. importance weights from the fill
        selection.keep_masked_positions(values, batch.lengths, batch.scored_mask())
    elif batch.score_from is not None:
        selection.fill_positions(values, batch.before_score_from())
    if not batch.return_logprobs and batch.cache_slots is None:  # a cache plan's tails keep
        values.pop("logprobs", None)  # them: the planner joins them and forms the losses
    return values

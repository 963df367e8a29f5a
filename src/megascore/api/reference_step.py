"""The step under a request's reference set (``options.reference``), and what it hands
the step under ``model`` (numpy, torch-free): :mod:`megascore.api.reference_kl` has the
estimators; the engine runs both steps on the same batch (``megascore.engine.runtime``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megascore.api import schema


def reference_batch(batch):
    """The step under the reference set: the same tokens, the logprobs only (every option
    at its default but ``logprob_positions``), with the inputs the table marks
    ``reference`` (loss mask, temperatures, routes, ``score_from``)."""
    options = {opt.name: opt.default for opt in schema.OPTIONS}
    options["logprob_positions"] = batch.logprob_positions
    inputs = {s.name: getattr(batch, s.name) if s.reference else None for s in schema.INPUTS}
    return dataclasses.replace(batch, **options, **inputs)


def with_reference(batch, reference_output):
    """``batch`` carrying the reference step's logprobs (the input ``reference_logprobs``)."""
    logprobs = np.asarray(reference_output.logprobs, np.float32)
    return dataclasses.replace(batch, reference_logprobs=logprobs)

"""The KL estimators between the scored set p and a reference set q (numpy, torch-free).

A request may name a second weight set (``options.reference``): the engine scores the
same tokens under it first (:mod:`megascore.api.reference_step`), hands its logprobs to
the step under ``model`` as the input ``reference_logprobs``, and the table's outputs are
formed from both (``megascore.api.schema.OUTPUTS``). Per token, with ``r = log q - log p`` (the
mismatch statistics' ``d`` with the reference as the scored side and p as the rollout,
:mod:`megascore.api.mismatch`, whose code this reuses):

* ``k1 = log p - log q`` (``-r``);
* ``k2 = r^2 / 2``;
* ``k3 = exp(r) - r - 1`` (:func:`megascore.api.mismatch.k3`; >= 0).

Entry 0 of each sequence is 0.0; the sequence means are over the scored tokens (the
loss mask from ``score_from``; 0.0 for a sequence without one), as the mismatch
statistics'. Source: Schulman, "Approximating KL divergence" (2020).
"""

from __future__ import annotations

import numpy as np

from megascore.api import layout, mismatch

NAMES = ("k1", "k2", "k3")
"""The estimators, in this order (the per-token outputs ``kl_<name>``)."""


def per_token(policy: np.ndarray, reference: np.ndarray, lengths: np.ndarray) -> dict:
    """float64 ``[T]`` per estimator (:data:`NAMES`), 0.0 at entry 0 of each sequence."""
    first = layout.effective_loss_mask(lengths, None) == 0
    r = np.where(first, 0.0, mismatch.log_ratio(reference, policy))
    k1 = np.where(first, 0.0, mismatch.log_ratio(policy, reference))
    return {"k1": k1, "k2": 0.5 * r * r, "k3": mismatch.k3(r)}


def means(policy, reference, lengths: np.ndarray, scored: np.ndarray | None) -> dict:
    """float64 ``[B]`` per estimator: its mean over each sequence's scored tokens."""
    mask = layout.effective_loss_mask(lengths, scored)
    tokens = per_token(policy, reference, lengths)
    return {name: mismatch.masked_mean(tokens[name], mask, lengths) for name in NAMES}

"""How each scalar request option of the table is checked and how a step of several
requests combines it (:data:`megascore.api.schema.OPTIONS` names these; numpy-free)."""

from __future__ import annotations

from megascore.api.errors import quoted


def check_top_k(value, limits) -> str | None:
    if not 0 <= value <= limits.max_top_k:
        return f"{value} is outside [0, max_top_k={limits.max_top_k}]"
    return None


def check_losses(value, limits) -> str | None:
    for i, name in enumerate(value):
        if name not in limits.loss_names:
            known = ", ".join(sorted(limits.loss_names)) or "none"
            return f"[{i}]: unknown loss {quoted(name)} (available: {known})"
    return None


def check_metrics(value, limits) -> str | None:
    if value and not limits.metrics_supported:
        return (
            "MoE / MTP metrics of a MoE model with TP > 1 need sequence_parallel, which the "
            "engine config disables (leave it unset to turn it on)"
        )
    return None


def check_metric_group(group: str, layers: str):
    """The check of ``return_<group>_metrics``: refused on a model without those layers
    (as routing on a dense model; for MTP layers a checkpoint declares but does not hold,
    saying so), then :func:`check_metrics`."""

    def check(value, limits) -> str | None:
        if value and group == "mtp" and limits.mtp_not_served:
            return f"the served model has no MTP layers: {limits.mtp_not_served}"
        if value and group not in limits.metric_groups:
            return (
                f"the served model has no {layers} layers (ModelInfo.{group}_metric_names is empty)"
            )
        return check_metrics(value, limits)

    return check


def check_routing(value, limits) -> str | None:
    if value and limits.routing is None:
        return "the served model has no MoE layers to route"
    return None


MAX_ID_CHARS = 256
"""Longest ``request_id`` / ``weights_version`` accepted."""


def check_version(value, limits) -> str | None:
    if len(value) > MAX_ID_CHARS:
        return f"{len(value)} characters, at most {MAX_ID_CHARS}"
    return None


def pinned(values: list) -> str:
    """The one version the requests of a step pin ("" when none does); the batcher
    never puts requests pinned to different versions in one step."""
    pins = {value for value in values if value}
    if len(pins) > 1:
        raise ValueError(f"a step's requests pin different weights versions: {sorted(pins)}")
    return pins.pop() if pins else ""


def same(values: list) -> str:
    """The one name (``model``, ``reference``) the requests of a step give; the batcher
    groups requests by it, so a step never mixes weight sets."""
    if len(set(values)) > 1:
        raise ValueError(f"a step's requests name different models: {sorted(set(values))}")
    return values[0] if values else ""


def union(values: list) -> tuple:
    return tuple(dict.fromkeys(name for names in values for name in names))


def one(values: list) -> bool:
    """Metrics are per forward: a step computes them only for a request alone in it."""
    return len(values) == 1 and bool(values[0])


LOGPROB_POSITIONS = {"all": 1, "masked": 2}
"""``ScoreOptions.logprob_positions`` by name (the ``LogprobPositions`` enum; 0, unset,
is every position as "all")."""
MASKED = LOGPROB_POSITIONS["masked"]


def check_positions(value, limits) -> str | None:
    if value not in (0, *LOGPROB_POSITIONS.values()):
        names = ", ".join(f"{v} = {name}" for name, v in LOGPROB_POSITIONS.items())
        return f"{value} is not a LogprobPositions value ({names})"
    return None


def masked(values: list) -> int:
    """A step computes the head only at the masked positions when all its requests ask
    for that (the others' results are cut to their mask afterwards)."""
    return MASKED if all(value == MASKED for value in values) else 0

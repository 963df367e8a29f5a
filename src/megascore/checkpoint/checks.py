"""The checks every checkpoint loader shares: the architecture comparison of a hot
reload and the rule that a load writes every tensor of the model exactly once.

Kept apart from :mod:`megascore.checkpoint.resolve` (which dispatches to the loaders)
so the loaders import them without an import circle.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

from megascore.api.errors import CheckpointError
from megascore.model.config import ModelConfig

NON_ARCHITECTURE_FIELDS = ("seed", "init_method_std", "architecture", "mtp_not_served")
"""ModelConfig fields that do not change the function the weights compute. The max length
is not one of them: the server's request limits come from it and stay fixed across reloads."""


def architecture_diff(a: ModelConfig, b: ModelConfig) -> list[str]:
    """``"field: a != b"`` for every field but :data:`NON_ARCHITECTURE_FIELDS` that differs."""
    out = []
    for f in dataclasses.fields(ModelConfig):
        if f.name in NON_ARCHITECTURE_FIELDS:
            continue
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if va != vb:
            out.append(f"{f.name}: {va!r} != {vb!r}")
    return out


def model_tensor_names(model) -> list[str]:
    """Names of the tensors a loader must write: the model's ``state_dict`` entries
    (parameters and persistent buffers) except the layers' ``_extra_state``."""
    return [n for n in model.state_dict(keep_vars=True) if not n.endswith("_extra_state")]


def check_every_parameter_written(
    expected: Iterable[str], written: Iterable[str], source: str
) -> None:
    """Raises unless a load writes every expected tensor exactly once.

    Run before the load overwrites anything, on what the loader plans to write (a
    recipe per parameter, the bridge's conversion tasks, the checkpoint's tensors).

    Args:
        expected: names the model needs (:func:`model_tensor_names`).
        written: one name per write the loader makes (repeats mean repeated writes).
        source: the checkpoint, for the message.

    Raises:
        CheckpointError: naming every parameter no mapping writes (it would keep its
            random initial value), written more than once, or not in the model.
    """
    expected = list(expected)
    counts = collections.Counter()
    for name in written:  # a dict (recipes) counts by key, not by value
        counts[name] += 1
    problems = []
    missing = [n for n in expected if not counts[n]]
    if missing:
        problems.append(f"{len(missing)} parameters written by no mapping: {missing}")
    twice = sorted(n for n, c in counts.items() if c > 1)
    if twice:
        problems.append(f"parameters written more than once: {twice}")
    unknown = sorted(set(counts) - set(expected))
    if unknown:
        problems.append(f"written names the model does not have: {unknown}")
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))


def check_same_architecture(new: ModelConfig, current: ModelConfig, source: str = "") -> None:
    """Raises unless ``new`` computes the same function shape as ``current`` (hot reload).

    The one architecture check of megascore (engine reloads, Megatron checkpoint
    loads). Ignores only the seed, init std and family label
    (:data:`NON_ARCHITECTURE_FIELDS`).

    Raises:
        CheckpointError: naming every differing field.
    """
    diff = architecture_diff(new, current)
    if diff:
        where = f"{source}: " if source else ""
        raise CheckpointError(f"{where}architecture differs from the served model: {diff}")

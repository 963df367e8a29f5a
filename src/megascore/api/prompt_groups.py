"""Groups of sequences sharing a prompt, the prompt sent once (``ScoreRequest.groups``).

numpy only, shared by the client (which finds the groups and compacts a request) and
the server (which expands it). A request's sequences form consecutive groups: group
``g`` holds ``sizes[g]`` sequences that all begin with the same ``prompts[g]`` tokens.
On the wire every per-token array holds, group after group, the prompt's rows once and
then each sequence's rows past the prompt; :func:`expand_index` maps the full layout
(every sequence whole, what ``lengths`` describes) to those wire rows and
:func:`wire_rows` picks them out of the full layout.
"""

from __future__ import annotations

import numpy as np

from megascore.api import layout

MIN_SHARED_PROMPT = 16
"""Shortest common prefix for which :func:`find_groups` groups consecutive sequences."""


def expand_index(lengths: np.ndarray, sizes: np.ndarray, prompts: np.ndarray) -> np.ndarray:
    """The wire row of every token of the full layout.

    Args:
        lengths: int64 ``[B]`` full sequence lengths.
        sizes: int64 ``[G]`` sequences per group (>= 1, summing to ``B``).
        prompts: int64 ``[G]`` prompt tokens per group (each <= its sequences' lengths).

    Returns:
        int64 ``[sum(lengths)]``: ``full[t] = wire[index[t]]``.
    """
    first = layout.offsets(sizes)[:-1]  # each group's first sequence
    seq_prompt = np.repeat(prompts, sizes)
    tails = lengths - seq_prompt
    pieces = np.insert(tails, first, prompts)  # group by group: the prompt, then the tails
    starts = layout.offsets(pieces)[:-1]
    group = np.repeat(np.arange(sizes.size), sizes)
    prompt_start = starts[first + np.arange(sizes.size)][group]
    tail_start = starts[np.arange(lengths.size) + group + 1]
    runs = np.stack([prompt_start, tail_start], axis=1).ravel()
    run_lengths = np.stack([seq_prompt, tails], axis=1).ravel()
    return layout.ranges(runs, run_lengths)


def wire_rows(lengths: np.ndarray, sizes: np.ndarray, prompts: np.ndarray) -> np.ndarray:
    """The rows of the full layout that go on the wire, in wire order: every token but
    the prompt rows of a group's sequences after its first.

    Returns:
        bool ``[sum(lengths)]``.
    """
    keep = np.ones(int(lengths.sum()), dtype=bool)
    first = layout.offsets(sizes)[:-1]
    later = np.setdiff1d(np.arange(lengths.size), first)
    shared = np.repeat(prompts, sizes)[later]
    keep[layout.ranges(layout.offsets(lengths)[later], shared)] = False
    return keep


def find_groups(
    lengths: np.ndarray, arrays: list[np.ndarray], min_shared: int = MIN_SHARED_PROMPT
) -> tuple[np.ndarray, np.ndarray] | None:
    """Groups consecutive sequences that share a prefix of at least ``min_shared`` tokens.

    A prefix is shared where every per-token array has equal rows (the token ids, and a
    loss mask, target ids, ... that the prompt's rows on the wire stand for). A sequence
    joins the group before it when the prefix it shares with the group's prompt is long
    enough and the tokens the group saves (``prompt x (size - 1)``) do not shrink;
    otherwise it opens a new group (a group of one has no prompt).

    Args:
        lengths: int64 ``[B]``.
        arrays: the per-token arrays, each ``[T, ...]`` (the token ids first).
        min_shared: shortest prompt worth sharing.

    Returns:
        ``(sizes, prompts)`` int64 ``[G]``, or None when no two sequences share one.
    """
    bounds = layout.offsets(lengths)
    rows = [np.reshape(a, (a.shape[0], -1)) for a in arrays]
    sizes: list[int] = []
    prompts: list[int] = []
    first, prompt = 0, 0  # the open group's first sequence and common prefix length
    for i in range(lengths.size):
        if i:
            m = int(min(prompt, lengths[i]))
            a, b = int(bounds[first]), int(bounds[i])
            differ = np.flatnonzero(
                np.any([(r[a : a + m] != r[b : b + m]).any(axis=1) for r in rows], axis=0)
            )
            shared = int(differ[0]) if differ.size else m
            n = sizes[-1]
            if shared >= min_shared and shared * n >= prompt * (n - 1):
                sizes[-1] += 1
                prompts[-1] = prompt = shared
                continue
        sizes.append(1)
        prompts.append(0)
        first, prompt = i, int(lengths[i])
    if len(sizes) == lengths.size:
        return None
    return np.array(sizes, dtype=np.int64), np.array(prompts, dtype=np.int64)

"""Trainer-shaped batches: padded ``[B, S]`` tensors in, padded logprobs out.

RL trainers hold rollouts as padded tensors, not lists of sequences. A
:class:`PaddedLayout` records where each row's real tokens sit, so that the client
scores only those (one sequence per non-empty row, padding never sent) and puts the
logprobs back in the trainer's layout:

* NeMo-RL (:func:`nemo_rl_layout`): right-padded ``input_ids [B, S]`` and
  ``input_lengths [B]``; the result is ``[B, S]`` with entry ``[b, t]`` =
  ``log p(input_ids[b, t] | input_ids[b, :t])`` for ``1 <= t < input_lengths[b]``, 0.0
  at ``t = 0`` and past the length (NeMo-RL's ``get_logprobs`` convention).
* groups (:func:`group_sequences`): GRPO-style prompts with n continuations each,
  scored as the sequences prompt + continuation, the loss mask on the continuations.
* verl (:func:`verl_layout`): ``input_ids [B, P + R]`` = left-padded prompts
  followed by right-padded ``responses [B, R]``, and ``attention_mask [B, P + R]`` (1
  on real tokens); the result is ``[B, R]`` with entry ``[b, j]`` = ``log p(responses[b,
  j] | the real tokens before it)`` where the response is real, 0.0 on response padding
  (the ``log_probs`` of verl's ``compute_log_prob``, which trainers multiply by the
  ``response_mask`` = ``attention_mask[:, -R:]``).

Inputs are numpy arrays or anything array-like; torch is never imported unless the
input is a torch tensor, and then the result is a float32 torch tensor on its device.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megascore_client.errors import InvalidInputError
from megascore_client.inputs import as_numpy

__all__ = ["PaddedLayout", "group_sequences", "nemo_rl_layout", "prompt_groups", "verl_layout"]


def _floats(value):
    """A float array-like (torch tensors detached to the host) as numpy."""
    if _is_torch(value):
        value = value.detach().cpu().double()
    return np.asarray(value)


def _is_torch(value) -> bool:
    return type(value).__module__.split(".")[0] == "torch"


def _ints(value, name: str, ndim: int) -> np.ndarray:
    array = as_numpy(value)
    if array.ndim != ndim:
        raise InvalidInputError(f"{name}: expected {ndim} dimensions, got shape {array.shape}")
    if array.dtype.kind not in "iub":
        raise InvalidInputError(f"{name}: expected integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


@dataclasses.dataclass(frozen=True)
class PaddedLayout:
    """Where the real tokens of a padded ``[B, S]`` batch are.

    Attributes:
        shape: ``(B, S)`` of the trainer's tensor.
        rows: int64 ``[N]``: the rows scored: those with a real token in the ``keep``
            columns (a verl row with an empty response is not sent).
        columns: per scored row, int64 column indices of its real tokens, in order.
        sequences: per scored row, its real tokens (what is sent).
        keep: the columns of the result (``slice(None)`` = all ``S``; verl: the last R).
        torch_like: the input whose type and device the result takes (None = numpy).
    """

    shape: tuple[int, int]
    rows: np.ndarray
    columns: list[np.ndarray]
    sequences: list[np.ndarray]
    keep: slice = slice(None)
    torch_like: object = None

    @classmethod
    def from_mask(
        cls, ids: np.ndarray, mask: np.ndarray, keep: slice = slice(None), torch_like=None
    ) -> PaddedLayout:
        """The layout of ``ids [B, S]`` whose real tokens are where ``mask`` is set; the
        rows scored are those with a real token in the ``keep`` columns."""
        rows = np.flatnonzero(mask[:, keep].any(axis=1))
        columns = [np.flatnonzero(mask[b]) for b in rows]
        sequences = [ids[b, c] for b, c in zip(rows, columns, strict=True)]
        return cls(ids.shape, rows, columns, sequences, keep, torch_like)

    def score_arguments(self, kwargs: dict) -> dict:
        """``score`` arguments of the layout's sequences from an adapter's ``kwargs``:
        a ``rollout_logprobs`` in the trainer's layout (``[B, S]``, or ``[B, R]`` with
        ``keep``) becomes one array per sequence. With ``keep`` the loss mask holds only
        the ``keep`` columns (the mismatch statistics count the response tokens only)
        and the logprobs are asked for there only (``logprob_positions="masked"``: the
        server runs the output head on the response rows, the result is the same)."""
        arguments = {"losses": (), **kwargs}
        if self.keep != slice(None):
            in_keep = np.zeros(self.shape[1], bool)
            in_keep[self.keep] = True
            arguments["loss_mask"] = [in_keep[c].astype(np.uint8) for c in self.columns]
            arguments["logprob_positions"] = "masked"
        rollout = kwargs.get("rollout_logprobs")
        if rollout is None:
            return arguments
        values = np.asarray(_floats(rollout), dtype=np.float64)
        width = self.shape[1] - (self.keep.start or 0)
        if values.shape != (self.shape[0], width):
            raise InvalidInputError(
                f"rollout_logprobs: shape {values.shape}, expected {(self.shape[0], width)} "
                "(the layout of the returned logprobs)"
            )
        full = np.zeros(self.shape)
        full[:, self.keep] = values
        pairs = zip(self.rows, self.columns, strict=True)
        arguments["rollout_logprobs"] = [full[b, c] for b, c in pairs]
        return arguments

    def answer(self, scored, kwargs: dict):
        """What an adapter returns: the logprobs in the layout (:meth:`logprobs`); with
        ``rollout_logprobs``, ``(logprobs, mismatch)``, ``mismatch`` a statistic name ->
        float64 ``[B]`` (0.0 for a row not scored)."""
        logprobs = self.logprobs(None if scored is None else scored.logprobs)
        if kwargs.get("rollout_logprobs") is None:
            return logprobs
        stats = {}
        for name, values in (scored.mismatch_stats if scored is not None else {}).items():
            stats[name] = np.zeros(self.shape[0])
            stats[name][self.rows] = values
        return logprobs, stats

    def logprobs(self, scored: list[np.ndarray] | None):
        """Puts the logprobs of the scored sequences (``ScoreResult.logprobs``, in the
        order of :attr:`sequences`; None when there were none) back in the layout.

        Returns:
            float32 ``[B, S]`` (or ``[B, R]`` with ``keep``), 0.0 where nothing was
            scored and at each sequence's first token; a torch tensor on the input's
            device when the input was one.
        """
        out = np.zeros(self.shape, dtype=np.float32)
        for b, cols, values in zip(self.rows, self.columns, scored or (), strict=True):
            out[b, cols] = values
        out = np.ascontiguousarray(out[:, self.keep])
        if self.torch_like is None:
            return out
        import torch  # the input is a torch tensor: torch is already loaded

        return torch.from_numpy(out).to(self.torch_like.device)


def nemo_rl_layout(input_ids, input_lengths) -> PaddedLayout:
    """The layout of NeMo-RL's right-padded ``input_ids [B, S]`` + ``input_lengths [B]``.

    Raises:
        InvalidInputError: not 2-D integer ids, lengths of another size, or a length
            outside ``[0, S]`` (named by row).
    """
    ids = _ints(input_ids, "input_ids", 2)
    lengths = _ints(input_lengths, "input_lengths", 1)
    batch, width = ids.shape
    if lengths.shape[0] != batch:
        raise InvalidInputError(f"input_lengths: {lengths.shape[0]} entries for {batch} rows")
    bad = np.flatnonzero((lengths < 0) | (lengths > width))
    if bad.size:
        b = int(bad[0])
        raise InvalidInputError(f"input_lengths[{b}] = {lengths[b]} is outside [0, {width}]")
    mask = np.arange(width)[None, :] < lengths[:, None]
    return PaddedLayout.from_mask(ids, mask, torch_like=input_ids if _is_torch(input_ids) else None)


def verl_layout(input_ids, attention_mask, responses) -> PaddedLayout:
    """The layout of verl's ``input_ids [B, P+R]`` / ``attention_mask [B, P+R]`` /
    ``responses [B, R]``, keeping the last R columns (the response slots).

    Raises:
        InvalidInputError: shapes that do not match, a mask that is not 0/1, or
            ``input_ids[:, -R:]`` that is not ``responses`` (named by row).
    """
    ids = _ints(input_ids, "input_ids", 2)
    mask = _ints(attention_mask, "attention_mask", 2)
    resp = _ints(responses, "responses", 2)
    batch, width = ids.shape
    if mask.shape != ids.shape:
        raise InvalidInputError(f"attention_mask: shape {mask.shape} != input_ids {ids.shape}")
    if resp.shape[0] != batch or resp.shape[1] > width:
        raise InvalidInputError(
            f"responses: shape {resp.shape} does not fit input_ids {ids.shape} ([B, R], R <= S)"
        )
    if not np.isin(mask, (0, 1)).all():
        raise InvalidInputError("attention_mask: values must be 0/1")
    prompt = width - resp.shape[1]
    differs = np.flatnonzero((ids[:, prompt:] != resp).any(axis=1))
    if differs.size:
        raise InvalidInputError(
            f"responses[{int(differs[0])}] differs from input_ids[{int(differs[0])}, -R:] "
            "(input_ids must be the prompt followed by the response)"
        )
    return PaddedLayout.from_mask(
        ids,
        mask.astype(bool),
        keep=slice(prompt, width),
        torch_like=input_ids if _is_torch(input_ids) else None,
    )


def group_sequences(prompts, continuations) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The sequences of groups (one prompt, its continuations) and their loss masks.

    Args:
        prompts: ``G`` token sequences (each 1-D, array-like).
        continuations: ``G`` lists of token sequences, one list per prompt.

    Returns:
        ``(sequences, masks)``: ``prompts[g] + continuations[g][j]`` for every group ``g``
        and continuation ``j``, in that order, and for each a uint8 mask that is 1 on the
        continuation's tokens.

    Raises:
        InvalidInputError: a count that does not match, or a group without continuations
            (named by group).
    """
    prompts = list(prompts)
    continuations = list(continuations)
    if len(prompts) != len(continuations):
        raise InvalidInputError(
            f"continuations: {len(continuations)} groups for {len(prompts)} prompts"
        )
    sequences, masks = [], []
    for g, (prompt, conts) in enumerate(zip(prompts, continuations, strict=True)):
        conts = list(conts)
        if not conts:
            raise InvalidInputError(f"continuations[{g}]: a group needs at least one continuation")
        head = _ints(prompt, f"prompts[{g}]", 1)
        for j, cont in enumerate(conts):
            tail = _ints(cont, f"continuations[{g}][{j}]", 1) if len(cont) else head[:0]
            sequences.append(np.concatenate([head, tail]))
            masks.append(np.r_[np.zeros(len(head), np.uint8), np.ones(len(tail), np.uint8)])
    return sequences, masks


def prompt_groups(layout: PaddedLayout) -> np.ndarray:
    """Runs of consecutive scored sequences of a verl layout that share their prompt
    (GRPO's n rollouts of one prompt, which verl keeps in consecutive rows).

    The prompt of a sequence is its real tokens before the response columns
    (``layout.keep``); a run ends where the next sequence's prompt differs (the same
    prompt again after another one starts a new run).

    Args:
        layout: a :func:`verl_layout`.

    Returns:
        int64 ``[G]``: the number of sequences in each run, in order; they sum to
        ``len(layout.sequences)`` (rows with an empty response are not scored, so not
        counted).
    """
    start = layout.keep.start or 0
    prompts = [
        seq[: int((cols < start).sum())]
        for seq, cols in zip(layout.sequences, layout.columns, strict=True)
    ]
    sizes: list[int] = []
    for i, prompt in enumerate(prompts):
        if i and np.array_equal(prompt, prompts[i - 1]):
            sizes[-1] += 1
        else:
            sizes.append(1)
    return np.array(sizes, dtype=np.int64)

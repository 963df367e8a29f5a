"""Token log-probabilities and top-k alternatives from vocab-parallel logits.

Each tensor-parallel rank holds a contiguous slice of the vocabulary
(``[tp_rank * V_local, (tp_rank + 1) * V_local)``, Megatron's ``VocabUtility``
layout) of the output-layer logits. The full-vocabulary logits are never
materialised: per chunk of tokens each rank computes its local max and sum of
exponentials in fp32, the TP group all-reduces them (MAX, then one SUM that
also carries the target logit from the rank owning the target), and the top-k
is a two-stage selection (local top-k, all-gather ``k`` candidates per rank,
top-k again).

The logits come from a :class:`ChunkedLogits` source that produces one chunk of
rows at a time: the engine passes the model's output head
(:class:`megascore.engine.outputs.output_head.OutputHead`, final hidden states times the
output weight), so not even this rank's ``[T, V_local]`` slice exists and peak
memory is ``O(chunk_tokens * V_local)`` whatever the number of tokens. A plain
``[T, V_local]`` tensor is accepted too (logits that already exist).

``tp_group=None`` means the logits are not sharded (the whole vocabulary is
local) and no collective is issued; a size-1 group gives the same numbers.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from typing import Protocol

import torch
import torch.distributed as dist

from megascore.api import schema
from megascore.engine.outputs.scratch import Scratch
from megascore.engine.outputs.vocab_top_k import chunk_top_k

logger = logging.getLogger(__name__)


class TokenScores(dict):
    """Per-token outputs of :func:`score_tokens` by :data:`megascore.api.schema.OUTPUTS` name,
    also read as attributes (None when not computed):

    * logprobs: float32 ``[T]``, ``log softmax(logits[t] / temperature[t])[targets[t]]``.
    * top_k_ids: int64 ``[T, k]`` global vocabulary ids, most likely first;
      top_k_logprobs: float32 ``[T, k]`` their log-probabilities.
    * the other head outputs of the table (entropy, token_ranks, ...) likewise, one row
      per token.
    """

    def __getattr__(self, name: str):
        if any(out.name == name for out in schema.OUTPUTS):
            return self.get(name)
        raise AttributeError(name)


class ChunkedLogits(Protocol):
    """Vocab-parallel logits ``[num_tokens, vocab_local]`` handed out one chunk at a time."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def vocab_local(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def logits(self, start: int, end: int) -> torch.Tensor:
        """``[end - start, vocab_local]`` logits of rows ``[start, end)``, any float dtype."""
        ...


@dataclasses.dataclass
class TensorLogits:
    """A :class:`ChunkedLogits` over a ``[T, V_local]`` tensor that already exists."""

    tensor: torch.Tensor

    def __post_init__(self):
        if self.tensor.dim() != 2:
            raise ValueError(f"logits must be [T, V_local], got shape {tuple(self.tensor.shape)}")

    @property
    def num_tokens(self) -> int:
        return self.tensor.shape[0]

    @property
    def vocab_local(self) -> int:
        return self.tensor.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def logits(self, start: int, end: int) -> torch.Tensor:
        return self.tensor[start:end]


class Float32Logits:
    """A :class:`ChunkedLogits` computing an output head's logits in float32
    (``--lm-head-dtype float32``, docs/engine.md).

    Megatron's output layer multiplies in the model dtype (bf16 logits on GPU) and
    its loss upcasts them; this multiplies the head's hidden states by the output
    weight both upcast, the weight once per step (``V/tp x H`` float32 on the device).

    Args:
        head: the model's :class:`megascore.engine.outputs.output_head.OutputHead` of this step.
    """

    def __init__(self, head):
        self.head = head
        weight = head.output_layer.weight if head.weight is None else head.weight
        self.weight = weight.detach().float()  # [V/tp, H]

    @property
    def num_tokens(self) -> int:
        return self.head.num_tokens

    @property
    def vocab_local(self) -> int:
        return self.weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.head.device

    def logits(self, start: int, end: int) -> torch.Tensor:
        rows = self.head.hidden_states[start:end, 0].float()  # [C, H]
        return self.head.scale_logits(self.head.matmul(rows, self.weight))


def _group_rank_size(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    if tp_group is None:
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def _chunk_log_normalizer(
    logits: torch.Tensor, tp_group: dist.ProcessGroup | None, tp_size: int, work: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global max and log-sum-exp of one chunk.

    Args:
        logits: float32 ``[C, V_local]`` (already divided by the temperature).
        tp_group: tensor-parallel group, or None for unsharded logits.
        tp_size: size of ``tp_group`` (1 when None).
        work: float32 scratch of at least ``[C, V_local]``, overwritten (reused across
            chunks: a fresh ``[C, V_local]`` temporary per chunk costs page faults).

    Returns:
        ``(global_max [C], sum_exp_local [C])``: the max over the full vocabulary
        and this rank's sum of ``exp(logits - global_max)``, not yet reduced.
    """
    # amax: the max without the argmax (max(dim) also computes indices, ~5x slower on CPU)
    global_max = logits.amax(dim=-1)
    if tp_size > 1:
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = torch.sub(logits, global_max.unsqueeze(-1), out=work[: logits.shape[0]])
    return global_max, shifted.exp_().sum(dim=-1)


@dataclasses.dataclass
class VocabShard:
    """This rank's slice of the vocabulary and the group that holds the others.

    Attributes:
        group: tensor-parallel group, or None for unsharded logits.
        size: size of ``group`` (1 when None).
        start: global id of this shard's column 0.
        vocab_size: true vocabulary size (padding columns at or above it never enter a
            top-k), or None to keep every column.
    """

    group: dist.ProcessGroup | None
    size: int
    start: int
    vocab_size: int | None


class ChunkScores:
    """One chunk of temperature-scaled vocab-parallel logits, normalised over the TP
    group, and what each head output of :data:`megascore.api.schema.OUTPUTS` reads from it
    (``Output.head``: ``chunk -> [C, *dims]``).

    Attributes:
        logits: float32 ``[C, V_local]`` scaled logits of this shard.
        lse: float32 ``[C]`` log-sum-exp over the full vocabulary.
        global_max: float32 ``[C]`` max over the full vocabulary.
        top_k_size: alternatives per token of this step.
        inputs: the chunk's rows of each head input of the table
            (:func:`megascore.api.schema.head_inputs`: ``target_ids`` ``[C, K]``, ...).
    """

    def __init__(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor | None,
        shard: VocabShard,
        work: torch.Tensor,
        top_k_size: int,
        inputs: dict[str, torch.Tensor] | None = None,
    ):
        self.logits, self.shard, self.work, self.top_k_size = logits, shard, work, top_k_size
        self.inputs = inputs or {}
        self.global_max, sum_exp = _chunk_log_normalizer(logits, shard.group, shard.size, work)
        # One SUM for both reductions: [2, C] (the target logit from the rank owning it)
        packed = sum_exp.unsqueeze(0)
        if targets is not None:
            packed = torch.stack([sum_exp, self._owned_logits(targets.unsqueeze(-1))[:, 0]])
        if shard.size > 1:
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=shard.group)
        self.lse = self.global_max + torch.log(packed[0])
        self._target_logit = packed[1] if targets is not None else None
        self._top_k: tuple[torch.Tensor, torch.Tensor] | None = None

    def _owned_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """``[C, n]`` logits of global ``ids [C, n]`` that this shard owns, 0 elsewhere."""
        local = ids.to(self.logits.device, torch.int64) - self.shard.start
        owned = (local >= 0) & (local < self.logits.shape[1])
        values = torch.gather(self.logits, -1, torch.where(owned, local, torch.zeros_like(local)))
        return torch.where(owned, values, torch.zeros_like(values))

    def target_logprobs(self) -> torch.Tensor:
        """float32 ``[C]`` log-probability of each row's target."""
        return self._target_logit - self.lse

    def _sum_over_tp(self, values: torch.Tensor) -> torch.Tensor:
        if self.shard.size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.shard.group)
        return values

    def entropy(self) -> torch.Tensor:
        """float32 ``[C]`` entropy of each row's distribution: ``lse - sum_v p_v * l_v``
        (this shard's sum, then one SUM over TP; the scratch holds ``p``)."""
        probs = torch.sub(self.logits, self.lse.unsqueeze(-1), out=self.work[: len(self.lse)])
        expected = probs.exp_().mul_(self.logits).sum(dim=-1)
        return self.lse - self._sum_over_tp(expected)

    def token_ranks(self) -> torch.Tensor:
        """int64 ``[C]`` rank of each row's target: the number of vocabulary ids whose
        scaled logit is ``>=`` the target's, the target included (1 = the most likely; a
        tie counts against the target, as vLLM's rank). Padding columns at or above
        ``vocab_size`` never count. This shard's count, then one SUM over TP."""
        shard, width = self.shard, self.logits.shape[1]
        valid = width if shard.vocab_size is None else shard.vocab_size - shard.start
        valid = min(max(valid, 0), width)
        at_least = self.logits[:, :valid] >= self._target_logit.unsqueeze(-1)
        return self._sum_over_tp(at_least.sum(dim=-1, dtype=torch.int64))

    def id_logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 ``[C, K]`` log-probabilities of global ``ids [C, K]`` (one SUM over TP)."""
        return self._sum_over_tp(self._owned_logits(ids)) - self.lse.unsqueeze(-1)

    def top_k(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [C, k] int64, logprobs [C, k] float32)``, most likely first (computed once)."""
        if self._top_k is None:
            shard = self.shard
            ids, vals = chunk_top_k(
                self.logits,
                self.top_k_size,
                shard.start,
                shard.vocab_size,
                shard.group,
                shard.size,
                self.work,
            )
            self._top_k = ids, vals - self.lse.unsqueeze(-1)
        return self._top_k


def head_options(top_k: int, inputs: dict[str, torch.Tensor]) -> types.SimpleNamespace:
    """What the head outputs' trailing shapes read (``Output.dims``), derived from the
    step: its ``top_k`` and ``num_<name>`` of each head input."""
    return types.SimpleNamespace(top_k=top_k, **schema.input_columns(inputs))


def _default_outputs(targets: torch.Tensor | None, top_k: int) -> list[schema.Output]:
    """The logprobs when there are targets, the top-k when ``top_k > 0``."""
    names = (["logprobs"] if targets is not None else []) + (
        ["top_k_ids", "top_k_logprobs"] if top_k > 0 else []
    )
    return [out for out in schema.OUTPUTS if out.name in names]


def _check_inputs(source, targets, temperature, top_k, chunk_tokens, full_vocab) -> None:
    """Stage 1 of :func:`score_tokens`: shapes and ranges, before any collective."""
    num_tokens = source.num_tokens
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if top_k < 0 or top_k > full_vocab:
        raise ValueError(f"top_k must be in [0, {full_vocab}], got {top_k}")
    if targets is not None and targets.shape != (num_tokens,):
        raise ValueError(f"targets must be [{num_tokens}], got {tuple(targets.shape)}")
    if temperature is not None and temperature.shape != (num_tokens,):
        raise ValueError(f"temperature must be [{num_tokens}], got {tuple(temperature.shape)}")


def _allocate(outputs: list[schema.Output], options, num_tokens: int, device) -> TokenScores:
    """Stage 2: one ``[T, *dims]`` buffer per output, filled like entry 0 of a sequence."""
    scores = TokenScores()
    for out in outputs:
        shape = (num_tokens, *schema.flat_dims(out, options))
        dtype = getattr(torch, out.dtype)
        scores[out.name] = torch.full(shape, out.fill, dtype=dtype, device=device)
    return scores


def score_tokens(
    logits: torch.Tensor | ChunkedLogits,
    targets: torch.Tensor | None,
    *,
    tp_group: dist.ProcessGroup | None,
    temperature: torch.Tensor | None = None,
    top_k: int = 0,
    chunk_tokens: int = 1024,
    vocab_size: int | None = None,
    outputs: list[schema.Output] | None = None,
    inputs: dict[str, torch.Tensor] | None = None,
    scratch: Scratch | None = None,
) -> TokenScores:
    """Per-token outputs (logprobs of ``targets``, top-k, ...) from vocab-parallel logits.

    Every rank of ``tp_group`` must call this with the same number of tokens,
    ``top_k``, ``chunk_tokens``, ``outputs`` and whether ``targets`` is given (the
    collectives are issued per chunk). Stages: check the inputs, allocate the
    outputs, then per chunk: the chunk's logits (scaled by the temperature), their
    normaliser over the TP group (:class:`ChunkScores`), each output's ``head``.

    Args:
        logits: this rank's vocabulary slice, ``[T, V_local]`` any float dtype: a
            tensor, or a :class:`ChunkedLogits` asked for one chunk of at most
            ``chunk_tokens`` rows at a time (in order, each row once).
        targets: int64 ``[T]`` global target ids, or None to skip the outputs that
            read them (logprobs, token ranks).
        tp_group: tensor-parallel group over which the vocabulary is split, or None
            when ``logits`` holds the full vocabulary.
        temperature: float32 ``[T]`` per-token temperature (> 0), or None for 1.0.
        top_k: number of alternatives per token (0 = none).
        chunk_tokens: tokens processed per chunk; bounds the working set (the chunk's
            logits and their fp32 copies) to ``chunk_tokens x V_local``.
        vocab_size: true vocabulary size; ids at or above it (padding columns)
            are excluded from the top-k. They still count in the softmax
            normaliser, as in Megatron's vocab-parallel cross-entropy.
        outputs: the head outputs to compute (:func:`megascore.api.schema.head_outputs`);
            None: the logprobs when ``targets`` is given and the top-k when ``top_k > 0``.
        inputs: ``[T, ...]`` rows of each head input of the table by name
            (:func:`megascore.api.schema.head_inputs`: ``target_ids`` int64 ``[T, K]``,
            whose logprobs ``target_logprobs`` returns); each chunk's outputs read its rows
            (``ChunkScores.inputs``). None: none.
        scratch: where the vocabulary-wide temporaries live
            (:mod:`megascore.engine.outputs.scratch`;
            the engine passes the head's, reused from step to step); None: new ones.

    Returns:
        A :class:`TokenScores` with float32 / int64 tensors on the logits' device.

    Raises:
        ValueError: on inconsistent shapes or a ``top_k`` larger than the vocabulary.
    """
    source = TensorLogits(logits) if isinstance(logits, torch.Tensor) else logits
    num_tokens, v_local = source.num_tokens, source.vocab_local
    tp_rank, tp_size = _group_rank_size(tp_group)
    full_vocab = v_local * tp_size if vocab_size is None else min(vocab_size, v_local * tp_size)
    _check_inputs(source, targets, temperature, top_k, chunk_tokens, full_vocab)
    if temperature is not None and bool((temperature == 1).all()):
        temperature = None  # x / 1 is x, bit for bit: no scaled copy of every chunk
    shard = VocabShard(tp_group, tp_size, tp_rank * v_local, vocab_size)
    outputs = _default_outputs(targets, top_k) if outputs is None else outputs
    device = source.device
    inputs = inputs or {}
    scores = _allocate(outputs, head_options(top_k, inputs), num_tokens, device)
    # Scratch reused by every chunk: the exp pass (and the padding mask of the top-k),
    # and the temperature-scaled logits.
    rows = min(chunk_tokens, num_tokens)
    scratch = Scratch() if scratch is None else scratch
    work = scratch.take("work", rows, v_local, torch.float32, device)
    scaled = (
        None if temperature is None else scratch.take("scaled", *work.shape, work.dtype, device)
    )
    with torch.no_grad():
        for start in range(0, num_tokens, chunk_tokens):
            end = min(start + chunk_tokens, num_tokens)
            # chunk: [C, V_local] fp32 (the only place vocabulary-wide rows exist)
            chunk = source.logits(start, end).float()
            if chunk.shape != (end - start, v_local):
                raise ValueError(f"chunk of rows [{start}, {end}) has shape {tuple(chunk.shape)}")
            if temperature is not None:
                temp = temperature[start:end].to(device, torch.float32).unsqueeze(-1)
                chunk = torch.div(chunk, temp, out=scaled[: end - start])
            tgt = None if targets is None else targets[start:end]
            rows_in = {name: values[start:end] for name, values in inputs.items()}
            context = ChunkScores(chunk, tgt, shard, work, top_k, rows_in)
            for out in outputs:
                scores[out.name][start:end] = out.head(context)
            # Free this chunk's logits before the head computes the next one (peak: one
            # chunk of logits plus the scratch, whatever the number of chunks).
            del chunk, context
    return scores

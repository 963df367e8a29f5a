"""One engine step on one rank: pack, forward, score, gather, agree, unpack.

Every rank of the replica runs :func:`run_step` with the same
:class:`~megascore.types.ScoreBatch` (broadcast by rank 0):

1. pack the flat ids for this rank's CP rank (NeMo-RL layout), with next-token
   targets rolled inside each padded segment on the *full* packed axis and
   then CP-sharded like the inputs;
2. ``forward_packed`` -> the output head (final hidden states + output layer);
3. logprobs / top-k over the TP group (:func:`megascore.engine.logprobs.score_tokens`),
   chunk by chunk: the head computes the vocab-parallel logits of ``chunk_tokens``
   rows at a time, so ``[T_local, V/tp]`` never exists;
4. the CP group that holds the output rank gathers the per-token results (each in
   its own dtype: top-k ids stay int64);
5. every rank all-reduces a per-rank failure flag over the status group, so a
   rank that raised anywhere in 1-4 is known to all (the others reach the flag
   after their own collectives time out) and :class:`StepFailedError` is raised
   on every rank.

The output rank then turns the gathered packed results into a
:class:`~megascore.types.ScoreOutput` with :func:`finish_step` (local work only),
through the packed <-> flat index that packing built (``token_positions``).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch
import torch.distributed as dist

from megascore import layout
from megascore.distributed import gather_cp_shards
from megascore.engine.forward import forward_packed
from megascore.engine.logprobs import Float32Logits, score_tokens
from megascore.engine.losses import compute_losses
from megascore.errors import WorkerLostError
from megascore.packing import PackedSequences, pack_sequences, roll_within_segments
from megascore.types import ScoreBatch, ScoreOutput

logger = logging.getLogger(__name__)


class StepFailedError(WorkerLostError):
    """A rank failed during a step; the collectives of the replica may be out of step."""


@dataclasses.dataclass(frozen=True)
class StepGroups:
    """The process groups a step uses (all required).

    Attributes:
        tp: tensor-parallel group (vocabulary split of the logits).
        cp: context-parallel group (token split of the packed sequence).
        status: every rank of the replica; carries the per-step failure flags.
            A gloo group whose timeout is the collective timeout.
    """

    tp: dist.ProcessGroup
    cp: dist.ProcessGroup
    status: dist.ProcessGroup


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Per-replica constants of a step.

    Attributes:
        pad_multiple: per-sequence pad multiple
            (:meth:`megascore.config.EngineConfig.pad_multiple`).
        chunk_tokens: tokens per chunk of the vocab-parallel log-softmax.
        vocab_size: true vocabulary size (padded logit columns never enter the top-k).
        device: device of the model inputs.
        output_rank: global rank that builds the :class:`ScoreOutput`.
        lm_head_dtype: "model" (logits in the model dtype, as Megatron) or "float32".
    """

    pad_multiple: int
    chunk_tokens: int
    vocab_size: int
    device: torch.device
    output_rank: int = 0
    lm_head_dtype: str = "model"


@dataclasses.dataclass
class StepResult:
    """What :func:`run_step` returns on a rank.

    The per-token tensors are in packed order (position ``p`` predicts the token at
    ``p + 1`` of its segment), gathered over CP, on the CPU, on the ranks of the
    output rank's CP group; None elsewhere and when not requested.

    Attributes:
        logprobs: float32 ``[T_padded]`` logprob of each position's target.
        top_k_ids: int64 ``[T_padded, k]``.
        top_k_logprobs: float32 ``[T_padded, k]``.
        token_positions: int64 ``[T]`` packed position of every token of the batch
            (:attr:`megascore.packing.PackedSequences.token_positions`).
        moe_metrics: MoE metric name -> value of this forward.
        mtp_metrics: MTP metric name -> value of this forward.
    """

    logprobs: torch.Tensor | None
    top_k_ids: torch.Tensor | None
    top_k_logprobs: torch.Tensor | None
    token_positions: torch.Tensor
    moe_metrics: dict[str, float]
    mtp_metrics: dict[str, float]


def _wants_logprobs(batch: ScoreBatch) -> bool:
    return batch.want_logprobs or bool(batch.losses)


def _megatron_loss_mask(batch: ScoreBatch, packed: PackedSequences) -> torch.Tensor:
    """The request's loss mask in Megatron's alignment on the full packed axis.

    Megatron's mask is aligned with the targets (entry ``p``: whether the target of
    packed position ``p``, token ``p + 1``, counts); the request's is aligned with
    the tokens (entry ``t``: whether token ``t`` counts; entry 0 never does).

    Returns:
        float32 ``[1, T_padded]`` (0 on pads and at every segment's last position).
    """
    lengths = np.asarray(batch.lengths, dtype=np.int64)
    mask = torch.from_numpy(layout.effective_loss_mask(lengths, batch.loss_mask)).float()
    cu_padded = packed.cu_seqlens_padded.cpu()
    full = torch.zeros(1, int(cu_padded[-1]))
    full[0, packed.token_positions] = mask
    return roll_within_segments(full, cu_padded, shifts=-1)


def _local_results(model, batch: ScoreBatch, groups: StepGroups, cfg: StepConfig) -> StepResult:
    """Steps 1-4 of the module docstring on this rank (issues the TP / CP collectives)."""
    device = cfg.device
    packed = pack_sequences(
        torch.from_numpy(np.asarray(batch.token_ids, dtype=np.int64)).to(device),
        batch.lengths,
        pad_individual_seqs_to_multiple_of=cfg.pad_multiple,
        cp_rank=dist.get_rank(groups.cp),
        cp_size=dist.get_world_size(groups.cp),
    )
    cu_padded = packed.cu_seqlens_padded.to("cpu", torch.int64)
    shard = packed.shard_indices
    # targets: [1, T_padded] rolled on the full axis -> [T_local], sharded like the inputs
    targets = roll_within_segments(packed.input_ids, cu_padded)[0, shard.to(device)]
    temperature = None
    if batch.temperature is not None:
        temps = torch.from_numpy(np.asarray(batch.temperature, dtype=np.float32))
        temperature = torch.repeat_interleave(temps, cu_padded.diff())[shard].to(device)
    # Metrics of a model without MoE / MTP layers are empty, not an error.
    want_moe = batch.want_moe_metrics and bool(model.config.num_moe_experts)
    want_mtp = batch.want_mtp_metrics and bool(model.config.mtp_num_layers)
    mtp_mask = None
    if want_mtp and batch.loss_mask is not None:
        mtp_mask = _megatron_loss_mask(batch, packed)[:, shard].to(device)

    outputs = forward_packed(
        model,
        packed,
        want_moe_metrics=want_moe,
        want_mtp_metrics=want_mtp,
        loss_mask_packed_local=mtp_mask,
    )
    scores = score_tokens(
        outputs.head if cfg.lm_head_dtype == "model" else Float32Logits(outputs.head),
        targets if _wants_logprobs(batch) else None,
        tp_group=groups.tp,
        temperature=temperature,
        top_k=batch.top_k,
        chunk_tokens=cfg.chunk_tokens,
        vocab_size=cfg.vocab_size,
    )

    on_output_side = cfg.output_rank in dist.get_process_group_ranks(groups.cp)

    def gathered(local: torch.Tensor | None) -> torch.Tensor | None:
        """``[T_local, ...]`` -> ``[T_padded, ...]`` on the CPU, same dtype."""
        if local is None or not on_output_side:
            return None
        return gather_cp_shards(local.unsqueeze(0), cu_padded.to(local.device), groups.cp)[0].cpu()

    return StepResult(
        logprobs=gathered(scores.logprobs),
        top_k_ids=gathered(scores.top_k_ids),
        top_k_logprobs=gathered(scores.top_k_logprobs),
        token_positions=packed.token_positions,
        moe_metrics=dict(outputs.moe_metrics),
        mtp_metrics=dict(outputs.mtp_metrics),
    )


def agree_on_status(failed: bool, status_group: dist.ProcessGroup) -> list[int]:
    """All-reduces one failure flag per rank.

    Args:
        failed: whether this rank failed the step.
        status_group: every rank of the replica (gloo, collective timeout).

    Returns:
        Global ranks that reported a failure (same list on every rank).

    Raises:
        RuntimeError: the all-reduce itself failed or timed out (a rank is gone).
    """
    ranks = dist.get_process_group_ranks(status_group)
    flags = torch.zeros(len(ranks), dtype=torch.int32)
    flags[dist.get_rank(status_group)] = int(failed)
    dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=status_group)
    return [ranks[i] for i in torch.nonzero(flags).flatten().tolist()]


def wait_for_device(device: torch.device) -> None:
    """Waits for the step's queued CUDA work, so that an asynchronous CUDA error (a
    faulting kernel, a failed NCCL collective) raises on this rank before it reports
    success to the status all-reduce. A no-op on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run_step(model, batch: ScoreBatch, groups: StepGroups, cfg: StepConfig) -> StepResult:
    """Runs one forward step on this rank and agrees on its outcome with every rank.

    Args:
        model: the (eval-mode) Megatron model of this rank.
        batch: the batch, identical on every rank.
        groups: process groups of the step.
        cfg: per-replica step constants.

    Returns:
        This rank's :class:`StepResult`.

    Raises:
        StepFailedError: on every rank when any rank failed the step (the message
            names the failed ranks and this rank's own error, if any).
    """
    error: BaseException | None = None
    result = None
    try:
        result = _local_results(model, batch, groups, cfg)
        wait_for_device(cfg.device)
    except Exception as e:  # reported to every rank through the status all-reduce
        logger.exception("rank %d: step failed", dist.get_rank())
        error = e
    try:
        failed = agree_on_status(error is not None, groups.status)
    except Exception as e:
        raise StepFailedError(f"step status all-reduce failed (a rank is lost): {e}") from e
    if failed:
        own = f"; this rank: {type(error).__name__}: {error}" if error is not None else ""
        raise StepFailedError(f"step failed on ranks {failed}{own}") from error
    assert result is not None
    return result


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

    Args:
        batch: the batch of the step.
        result: the output rank's :class:`StepResult`.

    Returns:
        The output in the batch's flat token layout (``weights_version`` left empty).
    """
    index = PredictionIndex.build(result.token_positions, batch.lengths)
    logprobs = index.to_flat(result.logprobs, 0.0)
    scored = logprobs if logprobs is not None else np.zeros(batch.num_tokens)
    losses, num_loss_tokens = compute_losses(
        batch.losses if logprobs is not None else (), scored, batch.lengths, batch.loss_mask
    )
    return ScoreOutput(
        logprobs=logprobs if batch.want_logprobs else None,
        top_k_ids=index.to_flat(result.top_k_ids, -1),
        top_k_logprobs=index.to_flat(result.top_k_logprobs, 0.0),
        losses=losses,
        num_loss_tokens=num_loss_tokens,
        moe_metrics=result.moe_metrics if batch.want_moe_metrics else {},
        mtp_metrics=result.mtp_metrics if batch.want_mtp_metrics else {},
    )

"""One engine step on one rank: pack, forward, score, gather, agree, unpack.

Every rank of the replica runs :func:`run_step` with the same
:class:`~megascore.types.ScoreBatch` (broadcast by rank 0):

1. pack the batch for this rank's CP rank (NeMo-RL layout), with next-token
   targets rolled inside each padded segment on the *full* packed axis and
   then CP-sharded like the inputs;
2. ``forward_packed`` -> the output head (final hidden states + output layer);
3. logprobs / top-k over the TP group (:func:`megascore.engine.logprobs.score_tokens`),
   chunk by chunk: the head computes the vocab-parallel logits of ``chunk_tokens``
   rows at a time, so ``[T_local, V/tp]`` never exists;
4. the CP group that holds the output rank gathers the per-token results;
5. every rank all-reduces a per-rank failure flag over the status group, so a
   rank that raised anywhere in 1-4 is known to all (the others reach the flag
   after their own collectives time out) and :class:`StepFailedError` is raised
   on every rank.

The output rank then turns the gathered packed results into a
:class:`~megascore.types.ScoreOutput` with :func:`finish_step` (local work only).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch
import torch.distributed as dist

from megascore.distributed import gather_cp_shards
from megascore.engine.forward import forward_packed
from megascore.engine.logprobs import Float32Logits, score_tokens
from megascore.engine.losses import compute_losses, effective_loss_mask, loss_names
from megascore.errors import WorkerLostError
from megascore.packing import cp_shard_indices, pack_sequences, roll_within_segments
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

    Attributes:
        packed: ``[T_padded, F]`` float64 gathered per-token results in packed order
            (column 0 logprob if computed, then ``k`` top-k ids, then ``k`` top-k
            logprobs), on the ranks of the output rank's CP group; None elsewhere.
        cu_seqlens_padded: int64 ``[B+1]`` padded segment boundaries (CPU).
        moe_metrics: MoE metric name -> value of this forward.
        mtp_metrics: MTP metric name -> value of this forward.
    """

    packed: torch.Tensor | None
    cu_seqlens_padded: torch.Tensor
    moe_metrics: dict[str, float]
    mtp_metrics: dict[str, float]


def validate_batch(
    batch: ScoreBatch, *, vocab_size: int, max_length: int, max_top_k: int, metrics_supported: bool
) -> None:
    """Checks a batch against the model before any collective (rank 0).

    Args:
        batch: the batch.
        vocab_size: token ids must be below it.
        max_length: longest sequence accepted.
        max_top_k: largest ``top_k`` accepted.
        metrics_supported: whether MoE / MTP metrics can be computed in this layout
            (False: a MoE model with TP > 1 and sequence parallelism disabled).

    Raises:
        ValueError: naming the offending field (and sequence).
    """
    lengths = np.asarray(batch.lengths)
    if lengths.ndim != 1 or lengths.size == 0:
        raise ValueError("lengths must be a non-empty 1-D array")
    bad = np.flatnonzero((lengths < 1) | (lengths > max_length))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"sequence {i}: length {int(lengths[i])} not in [1, {max_length}]")
    if int(lengths.sum()) != batch.num_tokens:
        raise ValueError(f"lengths sum to {int(lengths.sum())}, token_ids has {batch.num_tokens}")
    ids = np.asarray(batch.token_ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        seq = int(
            np.searchsorted(
                np.cumsum(lengths), np.flatnonzero((ids < 0) | (ids >= vocab_size))[0], side="right"
            )
        )
        raise ValueError(f"sequence {seq}: token ids must be in [0, {vocab_size})")
    if batch.loss_mask is not None and np.shape(batch.loss_mask) != (batch.num_tokens,):
        raise ValueError(f"loss_mask must have {batch.num_tokens} entries")
    temps = batch.temperatures()
    if np.shape(temps) != (batch.num_sequences,) or not (np.isfinite(temps) & (temps > 0)).all():
        raise ValueError("temperature must be finite and > 0, one per sequence")
    if not 0 <= batch.top_k <= max_top_k:
        raise ValueError(f"top_k must be in [0, {max_top_k}], got {batch.top_k}")
    unknown = sorted(set(batch.losses) - set(loss_names()))
    if unknown:
        raise ValueError(f"unknown losses {unknown}; known: {list(loss_names())}")
    if (batch.want_moe_metrics or batch.want_mtp_metrics) and not metrics_supported:
        raise ValueError(
            "MoE / MTP metrics of a MoE model with TP > 1 need sequence_parallel, which the "
            "engine config disables (leave it unset to turn it on)"
        )


def _wants_logprobs(batch: ScoreBatch) -> bool:
    return batch.want_logprobs or bool(batch.losses)


def _megatron_loss_mask(
    batch: ScoreBatch, cu_seqlens: torch.Tensor, cu_padded: torch.Tensor
) -> torch.Tensor:
    """The request's loss mask in Megatron's alignment on the full packed axis.

    Megatron's mask is aligned with the targets (entry ``p``: whether the target of
    packed position ``p``, token ``p + 1``, counts); the request's is aligned with
    the tokens (entry ``t``: whether token ``t`` counts; entry 0 never does).

    Returns:
        float32 ``[1, T_padded]`` (0 on pads and at every segment's last position).
    """
    lengths = np.asarray(batch.lengths, dtype=np.int64)
    mask = torch.from_numpy(effective_loss_mask(lengths, batch.loss_mask)).float()
    full = torch.zeros(1, int(cu_padded[-1]))
    full[0, _token_positions(cu_seqlens.cpu(), cu_padded)] = mask
    return roll_within_segments(full, cu_padded, shifts=-1)


def _token_positions(cu_seqlens: torch.Tensor, cu_padded: torch.Tensor) -> torch.Tensor:
    """int64 ``[T]`` packed position of every real token, in batch order."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = torch.repeat_interleave(cu_padded[:-1].long(), lens)
    within = torch.arange(int(lens.sum())) - torch.repeat_interleave(
        torch.cumsum(lens, 0) - lens, lens
    )
    return starts + within


def _local_results(model, batch: ScoreBatch, groups: StepGroups, cfg: StepConfig) -> StepResult:
    """Steps 1-4 of the module docstring on this rank (issues the TP / CP collectives)."""
    cp_rank, cp_size = dist.get_rank(groups.cp), dist.get_world_size(groups.cp)
    lengths = torch.from_numpy(np.asarray(batch.lengths, dtype=np.int64))
    ids = torch.from_numpy(np.asarray(batch.token_ids, dtype=np.int64))
    # rows: [B, S_max] right-padded with 0 (pack_sequences' input format)
    offsets = torch.cumsum(lengths, 0) - lengths
    rows = torch.zeros(len(lengths), int(lengths.max()), dtype=torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    rows[seq_of_token, torch.arange(len(ids)) - offsets[seq_of_token]] = ids
    packed = pack_sequences(
        rows.to(cfg.device),
        lengths,
        pad_individual_seqs_to_multiple_of=cfg.pad_multiple,
        cp_rank=cp_rank,
        cp_size=cp_size,
    )
    cu_padded = packed.cu_seqlens_padded.to("cpu", torch.int64)
    shard = cp_shard_indices(cu_padded, cp_rank, cp_size).to(cfg.device)
    # targets: [1, T] -> [1, T/cp]; rolled on the full axis, then sharded like the inputs
    targets = roll_within_segments(packed.input_ids, cu_padded, shifts=-1)[:, shard]
    temperature = None
    if batch.temperature is not None:
        seg_lens = cu_padded[1:] - cu_padded[:-1]
        temps = torch.from_numpy(np.asarray(batch.temperature, dtype=np.float32))
        temperature = torch.repeat_interleave(temps, seg_lens).to(cfg.device)[shard]

    # Metrics of a model without MoE / MTP layers are empty, not an error.
    want_moe = batch.want_moe_metrics and bool(model.config.num_moe_experts)
    want_mtp = batch.want_mtp_metrics and bool(model.config.mtp_num_layers)
    mtp_mask = None
    if want_mtp and batch.loss_mask is not None:
        mtp_mask = _megatron_loss_mask(batch, packed.cu_seqlens, cu_padded)[:, shard.cpu()]
    outputs = forward_packed(
        model,
        packed,
        want_moe_metrics=want_moe,
        want_mtp_metrics=want_mtp,
        loss_mask_packed_local=None if mtp_mask is None else mtp_mask.to(cfg.device),
    )
    k = batch.top_k
    scores = score_tokens(
        outputs.head if cfg.lm_head_dtype == "model" else Float32Logits(outputs.head),
        targets[0] if _wants_logprobs(batch) else None,
        tp_group=groups.tp,
        temperature=temperature,
        top_k=k,
        chunk_tokens=cfg.chunk_tokens,
        vocab_size=cfg.vocab_size,
    )
    # columns: [T_local, F] float64 (ids < 2**53 are exact)
    columns = []
    if scores.logprobs is not None:
        columns.append(scores.logprobs.double().unsqueeze(-1))
    if k > 0:
        columns += [scores.top_k_ids.double(), scores.top_k_logprobs.double()]
    gathered = None
    if columns and cfg.output_rank in dist.get_process_group_ranks(groups.cp):
        local = torch.cat(columns, dim=-1).unsqueeze(0)
        gathered = gather_cp_shards(local, cu_padded.to(local.device), groups.cp)[0].cpu()
    return StepResult(
        packed=gathered,
        cu_seqlens_padded=cu_padded,
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


def packed_to_flat(
    packed: torch.Tensor, cu_seqlens_padded: torch.Tensor, lengths: np.ndarray, fill: float
) -> np.ndarray:
    """Moves rolled-target results from packed order to the batch's flat token layout.

    Position ``p`` of a padded segment holds the prediction of token ``p + 1``;
    in the output, entry ``t`` of a sequence holds the prediction of token
    ``t`` and entry 0 holds ``fill``.

    Args:
        packed: ``[T_padded, F]`` per-token results in packed order.
        cu_seqlens_padded: int64 ``[B+1]`` padded boundaries.
        lengths: int64 ``[B]`` real lengths (>= 1).
        fill: value of entry 0 of each sequence.

    Returns:
        float64 ``[T, F]`` with ``T = lengths.sum()``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    seg_starts = cu_seqlens_padded[:-1].numpy().astype(np.int64)
    out_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    preds = lengths - 1  # predictions per sequence
    seq = np.repeat(np.arange(len(lengths)), preds)
    within = np.arange(int(preds.sum())) - np.repeat(np.cumsum(preds) - preds, preds)
    out = np.full((total, packed.shape[1]), fill, dtype=np.float64)
    out[out_starts[seq] + 1 + within] = packed.numpy()[seg_starts[seq] + within]
    return out


def finish_step(batch: ScoreBatch, result: StepResult) -> ScoreOutput:
    """Output rank: builds the :class:`ScoreOutput` from the gathered step results.

    Args:
        batch: the batch of the step.
        result: this rank's :class:`StepResult` (``packed`` set when anything was scored).

    Returns:
        The output in the batch's flat token layout (``weights_version`` left empty).
    """
    k = batch.top_k
    logprobs = top_ids = top_lps = None
    col = 0
    if _wants_logprobs(batch):
        logprobs = packed_to_flat(
            result.packed[:, :1], result.cu_seqlens_padded, batch.lengths, 0.0
        )[:, 0].astype(np.float32)
        col = 1
    if k > 0:
        top_ids = packed_to_flat(
            result.packed[:, col : col + k], result.cu_seqlens_padded, batch.lengths, -1.0
        ).astype(np.int64)
        top_lps = packed_to_flat(
            result.packed[:, col + k : col + 2 * k], result.cu_seqlens_padded, batch.lengths, 0.0
        ).astype(np.float32)
    if logprobs is not None:
        losses, num_loss_tokens = compute_losses(
            batch.losses, logprobs, batch.lengths, batch.loss_mask
        )
    else:
        losses, num_loss_tokens = compute_losses(
            (), np.zeros(batch.num_tokens), batch.lengths, batch.loss_mask
        )
    return ScoreOutput(
        logprobs=logprobs if batch.want_logprobs else None,
        top_k_ids=top_ids,
        top_k_logprobs=top_lps,
        losses=losses,
        num_loss_tokens=num_loss_tokens,
        moe_metrics=result.moe_metrics if batch.want_moe_metrics else {},
        mtp_metrics=result.mtp_metrics if batch.want_mtp_metrics else {},
    )

"""One packed forward outside the engine's step, for tests: ``forward_packed`` and the
full logits of its output head.

The engine runs every forward through Megatron's schedule
(:mod:`megascore.engine.schedule.pipeline`); tests that check the model itself (parity across
layouts, checkpoints, dtypes, metrics) call the same pieces directly on one stage.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megascore.engine.layout.packing import PackedSequences, pack_sequences
from megascore.engine.outputs.output_head import OutputHead
from megascore.engine.ranks.distributed import gather_cp_shards
from megascore.engine.schedule.forward import forward_microbatch, scoring_forward


@dataclasses.dataclass
class ModelOutputs:
    """Result of :func:`forward_packed` on one rank.

    Attributes:
        head: computes this rank's vocab-parallel logits chunk by chunk; row ``t``
            predicts the token after packed position ``t`` of this rank's CP shard.
        moe_metrics: name -> value, reduced across ranks (identical on every rank).
        mtp_metrics: ``mtp_{i}_loss`` and ``mtp_{i}_acceptance_rate`` (percent, as
            Megatron logs it), i from 1, reduced across ranks.
    """

    head: OutputHead
    moe_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    mtp_metrics: dict[str, float] = dataclasses.field(default_factory=dict)


def forward_packed(
    model,
    packed: PackedSequences,
    *,
    return_moe_metrics: bool = False,
    return_mtp_metrics: bool = False,
    loss_mask_packed_local: torch.Tensor | None = None,
    metrics_reduction: str = "step",
    data_parallel_split: bool = False,
) -> ModelOutputs:
    """Runs the model on this rank's shard of a packed batch (one stage, no schedule).

    Every rank of the replica calls it with the same batch packed for its own
    ``cp_rank`` (the model's ``pg_collection.cp``) and the same flags.

    Args:
        model: a ``GPTModel`` from ``megascore.model.build.build_model`` (eval mode).
        packed: the batch, packed for this rank's CP rank (``input_ids_cp_sharded``
            is the model input; ``input_ids`` the full packed ids).
        return_moe_metrics: compute the MoE aux-loss metrics (MoE models only).
        return_mtp_metrics: compute the MTP metrics (MTP models only).
        loss_mask_packed_local: ``[1, T_local]`` or ``[T_local]`` Megatron-style loss
            mask for the MTP metrics (entry t: whether the target of position t
            counts), CP-sharded. None: every target that is a real token of the
            same sequence.
        metrics_reduction: "step" or "microbatch" (Megatron's trackers; for one
            forward they differ in the sequence-level loss only).
        data_parallel_split: the DP ranks pass different batches (their step-level
            statistics are summed, not counted once).

    Returns:
        The output head (vocab-parallel logits chunk by chunk) and the requested
        metrics (empty dicts otherwise).

    Raises:
        ValueError: metrics requested from a model that has none. (MoE training-mode
            metrics at TP > 1 also need sequence parallelism: the engine refuses such
            requests up front, :meth:`megascore.config.EngineConfig.metrics_supported`.)
    """
    with scoring_forward(
        model,
        return_moe_metrics=return_moe_metrics,
        return_mtp_metrics=return_mtp_metrics,
        metrics_reduction=metrics_reduction,
        data_parallel_split=data_parallel_split,
    ) as metrics:
        head = forward_microbatch(
            model,
            packed,
            metrics_forward=return_moe_metrics or return_mtp_metrics,
            loss_mask_packed_local=loss_mask_packed_local,
        )
    return ModelOutputs(head=head, moe_metrics=metrics.moe, mtp_metrics=metrics.mtp)


def pack_for_rank(ids: torch.Tensor, lengths, pgs, pad_multiple: int = 1) -> PackedSequences:
    """``pack_sequences`` of the flat ``ids`` for this rank's CP rank of ``pgs``."""
    return pack_sequences(
        ids,
        torch.as_tensor(lengths),
        pad_individual_seqs_to_multiple_of=pad_multiple,
        cp_rank=pgs.cp.rank(),
        cp_size=pgs.cp.size(),
    )


def full_logits(out: ModelOutputs, packed: PackedSequences, pgs) -> torch.Tensor:
    """``[T, V]`` logits of the whole packed batch on every rank: this rank's
    vocab-parallel ``[T_local, V / tp]`` gathered over TP, then the CP shards (small
    batches only: the full logits are materialised)."""
    logits = out.head.logits(0, out.head.num_tokens)  # [T_local, V / tp]
    tp = dist.get_world_size(pgs.tp)
    if tp > 1:
        shards = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(shards, logits.contiguous(), group=pgs.tp)
        logits = torch.cat(shards, dim=-1)  # [T_local, V]
    return gather_cp_shards(logits[None], packed.cu_seqlens_padded, pgs.cp)[0]

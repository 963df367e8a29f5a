"""A packed microbatch as the model's arguments, on this rank's CP shard.

:func:`model_inputs` builds the keyword arguments of ``model(...)`` for a
:class:`~megascore.engine.layout.packing.PackedSequences`: its ids, the position of every token in
its sequence (:func:`packed_position_ids`), the packing's ``PackedSeqParams`` and the
``output_processor`` hook that hands over the
:class:`~megascore.engine.outputs.output_head.OutputHead`
instead of computing logits; for a metrics forward Megatron's MoE ``padding_mask``
(:func:`packed_padding_mask`) and the MTP ``labels`` / ``loss_mask``
(:func:`packed_labels_and_mask`). :func:`router_token_counts` counts the real tokens each
router sees (the weights of the ranks' z-loss, :mod:`megascore.engine.schedule.forward`).
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from megascore.engine.layout.packing import PackedSequences, cp_shard_indices, roll_within_segments
from megascore.engine.layout.segment_packing import full_positions
from megascore.engine.outputs import step_metrics
from megascore.engine.outputs.output_head import OutputHead, head_scratch


def packed_position_ids(
    cu_seqlens_padded: torch.Tensor, cp_rank: int, cp_size: int, params=None
) -> torch.Tensor:
    """Position of every token in its sequence, CP-sharded.

    Args:
        cu_seqlens_padded: ``[B+1]`` padded boundaries.
        cp_rank: this rank in the CP group.
        cp_size: CP group size.
        params: the packing's ``PackedSeqParams``: positions of segments that continue
            a shared prefix continue from it
            (:class:`megascore.engine.layout.segment_packing.SharedPrefixParams`).

    Returns:
        int64 ``[1, T / cp_size]`` (positions restart at 0 for every sequence).
    """
    cu = cu_seqlens_padded.to("cpu", torch.long)
    pos = full_positions(cu, params)
    return pos[cp_shard_indices(cu, cp_rank, cp_size)].unsqueeze(0)


def _position_and_length(packed: PackedSequences) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[T]`` pairs over the full packed axis: position inside the padded
    segment and the real length of the segment's sequence."""
    cu = packed.cu_seqlens.to("cpu", torch.long)
    cu_pad = packed.cu_seqlens_padded.to("cpu", torch.long)
    seg = cu_pad[1:] - cu_pad[:-1]
    pos = torch.arange(int(cu_pad[-1])) - torch.repeat_interleave(cu_pad[:-1], seg)
    return pos, torch.repeat_interleave(cu[1:] - cu[:-1], seg)


def packed_labels_and_mask(packed: PackedSequences, cp_rank: int, cp_size: int):
    """Next-token targets and Megatron's loss mask for this CP shard.

    Targets are rolled by -1 inside each padded segment on the full packed axis,
    then sharded like the inputs. The mask is Megatron's (aligned with the
    targets): 1 where the target of position ``t`` is a real token of the same
    sequence (``t + 1 < length``).

    Args:
        packed: the packed batch (full ``input_ids`` and boundaries are used).
        cp_rank: this rank in the CP group.
        cp_size: CP group size.

    Returns:
        ``(labels int64 [1, T_local], loss_mask float32 [1, T_local])``.
    """
    cu_pad = packed.cu_seqlens_padded.to("cpu")
    idx = cp_shard_indices(cu_pad, cp_rank, cp_size)
    ids = packed.input_ids.to("cpu", torch.long)
    labels = roll_within_segments(ids, cu_pad, shifts=-1)[:, idx]
    pos, length = _position_and_length(packed)
    return labels, (pos + 1 < length)[idx][None].float()


def packed_padding_mask(packed: PackedSequences, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Megatron's MoE ``padding_mask`` for this CP shard: bool ``[1, T_local]``, True at the
    pad positions of each padded segment (position >= the sequence's real length)."""
    pos, length = _position_and_length(packed)
    idx = cp_shard_indices(packed.cu_seqlens_padded.to("cpu"), cp_rank, cp_size)
    return (pos >= length)[idx][None]


def _head_processor(*, hidden_states, output_layer, output_weight, scale_logits, **_):
    """GPTModel ``output_processor``: hands over the head instead of computing logits.

    ``hidden_states`` is ``[s, 1, H]`` after the final layernorm (and, with MTP, the
    main model's share of the MTP block's output); with sequence parallelism ``s`` is
    this rank's ``T_local / tp`` rows, gathered here over TP once (``T_local x H``).
    """
    hidden = hidden_states.detach()
    if output_layer.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=False, group=output_layer.tp_group
        )
    return OutputHead(
        hidden_states=hidden,
        output_layer=output_layer,
        weight=None if output_weight is None else output_weight.detach(),
        scale_logits=scale_logits,
        scratch=head_scratch(output_layer),
    )


def router_token_counts(model, packed: PackedSequences):
    """Real tokens the router of each MoE-capable layer sees on this rank.

    Decoder layers see this rank's share of the real tokens (its CP shard; with sequence
    parallelism its TP slice of that: :func:`megascore.engine.outputs.step_metrics.router_rows`);
    MTP layer k sees the positions whose token k ahead is real (``position + k < length``).

    Returns:
        float32 ``[num_layers + mtp_num_layers]``.
    """
    cfg = model.config
    pos, length = _position_and_length(packed)
    rows = step_metrics.router_rows(model, packed)
    pos, length = pos[rows], length[rows]
    counts = [float((pos < length).sum())] * cfg.num_layers
    counts += [float((pos + k < length).sum()) for k in range(1, (cfg.mtp_num_layers or 0) + 1)]
    return torch.tensor(counts)


def _cp_rank_size(model) -> tuple[int, int]:
    """This rank's (CP rank, CP size) in the model's context-parallel group."""
    cp = model.pg_collection.cp
    return (cp.rank(), cp.size()) if cp.size() > 1 else (0, 1)


def model_inputs(
    model,
    packed: PackedSequences,
    *,
    metrics_forward: bool = False,
    loss_mask_packed_local: torch.Tensor | None = None,
) -> dict:
    """Keyword arguments of ``model(...)`` for this rank's shard of a packed batch.

    Every pipeline stage passes the same inputs (the first embeds ``input_ids``; the
    last needs them for MTP); the output processor hands over the :class:`OutputHead`.

    Args:
        model: the GPTModel.
        packed: the batch, packed for this rank's CP rank.
        metrics_forward: a forward that records MoE / MTP metrics: MoE models get
            Megatron's ``padding_mask`` (pads stay out of the router statistics), MTP
            models the MTP ``labels`` and ``loss_mask``.
        loss_mask_packed_local: ``[1, T_local]`` Megatron-style loss mask for the MTP
            metrics, CP-sharded; None: every target that is a real token of its sequence.

    Returns:
        The keyword arguments.
    """
    cp_rank, cp_size = _cp_rank_size(model)
    device = next(model.parameters()).device
    p = packed.packed_seq_params
    # The torch backend keeps the boundaries on the host: Megatron's THD RoPE (a loop
    # over the sequences with .item()), the core attention's plan and the MTP roll read
    # them in every layer, which on a GPU would be ~2B+5 host syncs per layer. TE's
    # kernels take them on the device.
    where = "cpu" if getattr(model, "megascore_attention_backend", "torch") == "torch" else device
    kwargs = dict(
        input_ids=packed.input_ids_cp_sharded.to(device, torch.long),  # [1, T_local]
        position_ids=packed_position_ids(p.cu_seqlens_q_padded, cp_rank, cp_size, p).to(device),
        attention_mask=None,
        packed_seq_params=dataclasses.replace(
            p,
            cu_seqlens_q=p.cu_seqlens_q.to(where),
            cu_seqlens_kv=p.cu_seqlens_kv.to(where),
            cu_seqlens_q_padded=p.cu_seqlens_q_padded.to(where),
            cu_seqlens_kv_padded=p.cu_seqlens_kv_padded.to(where),
        ),
        output_processor=_head_processor,
    )
    cfg = model.config
    if metrics_forward and cfg.num_moe_experts:
        padding_mask = packed_padding_mask(packed, cp_rank, cp_size)  # [1, T_local]
        tp = model.pg_collection.tp
        if cfg.sequence_parallel and not model.pre_process and tp.size() > 1:
            # GPTModel scatters the mask to the sequence-parallel region only on the first
            # pipeline stage; later stages get this rank's contiguous slice from here.
            per = padding_mask.shape[1] // tp.size()
            padding_mask = padding_mask[:, tp.rank() * per : (tp.rank() + 1) * per]
        kwargs.update(padding_mask=padding_mask.to(device))
    if metrics_forward and cfg.mtp_num_layers:
        labels, loss_mask = packed_labels_and_mask(packed, cp_rank, cp_size)
        if loss_mask_packed_local is not None:
            loss_mask = loss_mask_packed_local.reshape(1, -1).float()
        kwargs.update(labels=labels.to(device), loss_mask=loss_mask.to(device))
    return kwargs

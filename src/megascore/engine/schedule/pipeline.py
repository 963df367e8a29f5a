"""A step's forward through Megatron's own schedule, in microbatches.

Every layout runs the step through ``megatron.core.pipeline_parallel.
get_forward_backward_func()`` with ``forward_only=True``: the 1F1B schedule
without interleaving under pipeline parallelism (stages overlap on different
microbatches), the plain loop at PP = 1. The pieces follow NeMo-RL's logprob
path (``forward_step_arbitrary_loss`` / its loss post-processors):

* :func:`~megascore.engine.layout.microbatch_plan.split_microbatches`: contiguous runs of
  sequences, balanced by padded tokens; every microbatch is packed
  (:func:`~megascore.engine.layout.microbatch.build_microbatch`: THD, the per-sequence pad
  multiple) and padded to one common length, so the stages exchange activations of a
  fixed shape. The padding is a segment of its own (``pack_sequences(pad_segment=True)``),
  not an extension of the last sequence: no real token attends to it, and a
  sequence's attention has the same shape in any microbatch (batch invariance).
  Megatron refuses ``variable_seq_lengths`` with the allgather MoE dispatcher, the
  one that runs on the CPU. A microbatch is
  never shorter than the step's longest sequence (that would pad every other
  microbatch up to it), so a step may use fewer microbatches than configured.
* :func:`forward_step`: called by the schedule with the data iterator and the
  model; runs the model on the next microbatch (around it, the MoE routers take the
  microbatch's routes to replay or give back the ones they chose,
  :mod:`megascore.engine.outputs.routing`) and returns the output with a loss closure. On
  the last stage the output is the model's
  :class:`~megascore.engine.outputs.output_head.OutputHead`, and the closure computes the
  logprobs / top-k chunk by chunk over the TP group, gathers the CP shards and
  returns a loss normalised by the step's global valid token count
  (``cp_normalize`` under CP, then undoing Megatron's ``x cp / num_microbatches``
  scaling, as NeMo-RL does) with the per-token results.

The results stay on the last stage; :mod:`megascore.engine.schedule.step` moves them to
the output rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from megascore.api import schema
from megascore.engine.layout.microbatch import Microbatch
from megascore.engine.outputs.logprobs import Float32Logits, score_tokens
from megascore.engine.outputs.routing import recorded_routes, set_replay_targets
from megascore.engine.outputs.step_metrics import TokenRows
from megascore.engine.ranks.distributed import gather_cp_shards
from megascore.engine.schedule.forward import forward_microbatch
from megascore.model.lora import attach

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ScoreSpec:
    """What the last stage computes for every microbatch of a step.

    Attributes:
        outputs: the head outputs to compute (:func:`megascore.api.schema.head_outputs`).
        top_k: alternatives per position (0 = none).
        chunk_tokens: rows per chunk of the vocab-parallel log-softmax.
        vocab_size: true vocabulary size.
        global_valid_tokens: scored tokens of the whole step (loss normaliser, >= 1).
        num_microbatches: microbatches of the step.
        gather: this rank's CP group gathers the per-token results (the output side).
        metrics_forward: the forwards record MoE / MTP metrics
            (:func:`megascore.engine.schedule.packed_inputs.model_inputs`).
        lm_head_dtype: "model" (logits in the model dtype, as Megatron) or "float32".
        record_routes: keep each microbatch's MoE routes (``Microbatch.recorded_routes``).
        scored_rows_only: compute the output head and log-softmax only at the rows that
            predict a scored token (``Microbatch.loss_mask``); the other rows get each
            output's fill. For steps that return no per-token output (no logprobs, no
            top-k), or that ask for them at the masked positions only
            (``logprob_positions`` "masked").
    """

    outputs: tuple[schema.Output, ...]
    top_k: int
    chunk_tokens: int
    vocab_size: int
    global_valid_tokens: int
    num_microbatches: int
    gather: bool
    metrics_forward: bool
    lm_head_dtype: str = "model"
    record_routes: bool = False
    scored_rows_only: bool = False


def _score_microbatch(
    mb: Microbatch, spec: ScoreSpec, tp_group, cp_group, head
) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """The loss closure (last stage): per-token results, the results at each sequence's
    last row (:func:`_score_last_rows`) and the normalised loss."""
    cu_padded = mb.packed.cu_seqlens_padded.to("cpu", torch.int64)
    per_token = [out for out in spec.outputs if not schema.at_last_row(out)]
    targets, temperature, inputs, rows = mb.targets, mb.temperature, mb.head_inputs, None
    source = head
    if spec.scored_rows_only:  # the output head runs only where a scored token is predicted
        rows = mb.loss_mask.nonzero().squeeze(1)
        source = dataclasses.replace(head, hidden_states=head.hidden_states[rows])
        targets = targets[rows]
        temperature = None if temperature is None else temperature[rows]
        inputs = {name: values[rows] for name, values in inputs.items()}
    scores = score_tokens(
        source if spec.lm_head_dtype == "model" else Float32Logits(source),
        targets,
        tp_group=tp_group,
        temperature=temperature,
        top_k=spec.top_k,
        chunk_tokens=spec.chunk_tokens,
        vocab_size=spec.vocab_size,
        inputs=inputs,
        scratch=head.scratch,
        # the logprobs always: Megatron's schedule takes a loss from every microbatch
        outputs=list(dict.fromkeys([schema.output("logprobs"), *per_token])),
    )
    if rows is not None:  # [T_local, ...]: each output's fill where nothing was scored
        for name, value in list(scores.items()):
            if value is None:
                continue
            full = torch.full(
                (len(mb.loss_mask), *value.shape[1:]),
                schema.output(name).fill,
                dtype=value.dtype,
                device=value.device,
            )
            full[rows] = value
            scores[name] = full
    # loss: this CP shard's share of the step's token-mean NLL (NeMo-RL's normalisation
    # by the global valid token count); the CP ranks' shares sum to the microbatch's
    loss = -(scores.logprobs * mb.loss_mask).sum() / spec.global_valid_tokens
    cp_size = dist.get_world_size(cp_group)
    local_loss = loss.detach().clone()
    # cp_normalize, then undo Megatron's (x cp_size / num_microbatches) averaging
    loss = loss / cp_size * spec.num_microbatches / cp_size
    if cp_size > 1:
        dist.all_reduce(local_loss, group=cp_group)
    results = {"loss": local_loss.cpu()}
    for out in per_token:  # [T_local, ...] -> [T_padded, ...] on the CPU, same dtype
        if spec.gather:
            local = scores[out.name].unsqueeze(0)
            gathered = gather_cp_shards(local, cu_padded.to(local.device), cp_group)[0]
            results[out.name] = gathered.cpu()
    last = [out for out in spec.outputs if schema.at_last_row(out)]
    if last:
        results.update(_score_last_rows(mb, spec, last, tp_group, cp_group, head))
    return loss, results


def _score_last_rows(
    mb: Microbatch, spec: ScoreSpec, outputs: list[schema.Output], tp_group, cp_group, head
) -> dict[str, torch.Tensor]:
    """The outputs read at the last row of each sequence (the prediction after its last
    token, :func:`megascore.api.schema.at_last_row`): the head of those rows only, with a
    top-k of ``max(1, top_k)``, then one SUM over CP (each row lives on one CP rank).

    Returns:
        Output name -> ``[B_mb, *dims]`` on the CPU in the microbatch's sequence order
        (where this rank's CP group gathers the results; else empty).
    """
    rows = mb.last_rows.to(head.hidden_states.device)
    sub = dataclasses.replace(head, hidden_states=head.hidden_states[rows])
    scores = score_tokens(
        sub if spec.lm_head_dtype == "model" else Float32Logits(sub),
        None,
        tp_group=tp_group,
        temperature=None if mb.temperature is None else mb.temperature[rows],
        top_k=max(1, spec.top_k),
        chunk_tokens=spec.chunk_tokens,
        vocab_size=spec.vocab_size,
        scratch=head.scratch,
        outputs=outputs,
    )
    results = {}
    if not spec.gather:
        return results
    for out in outputs:
        value = scores[out.name]
        full = torch.zeros(
            (mb.num_sequences, *value.shape[1:]), dtype=value.dtype, device=value.device
        )
        full[mb.last_sequences.to(value.device)] = value
        if dist.get_world_size(cp_group) > 1:  # one rank holds each row, the others 0
            dist.all_reduce(full, group=cp_group)
        results[out.name] = full.cpu()
    return results


def forward_step(data_iterator, model, *, spec: ScoreSpec):
    """Megatron forward-step function (NeMo-RL's ``forward_step_arbitrary_loss`` shape).

    Args:
        data_iterator: yields this step's :class:`Microbatch` objects in order.
        model: this rank's GPTModel (one stage).
        spec: what the loss closure computes.

    Returns:
        ``(output, loss closure)``: the hidden states for the next stage, or on the
        last stage the :class:`~megascore.engine.outputs.output_head.OutputHead` that the closure
        scores.
    """
    mb = next(data_iterator)
    if mb.replay_routes is not None:
        set_replay_targets(model, mb.replay_routes)
    rows = (
        contextlib.nullcontext() if mb.adapter_rows is None else attach(model).rows(mb.adapter_rows)
    )
    with rows:  # the LoRA adapter of every row, on every stage
        output = forward_microbatch(
            model,
            mb.packed,
            metrics_forward=spec.metrics_forward,
            loss_mask_packed_local=mb.mtp_loss_mask,
            tokens=None if mb.lengths is None else TokenRows(mb.token_positions, mb.lengths),
        )
    if spec.record_routes:
        mb.recorded_routes = recorded_routes(model)
    pgs = model.pg_collection
    return output, functools.partial(_score_microbatch, mb, spec, pgs.tp, pgs.cp)


def run_schedule(model, microbatches: list[Microbatch], spec: ScoreSpec) -> list[dict]:
    """Runs the microbatches through Megatron's forward-only schedule on this rank.

    Collective over the replica (p2p between stages; TP / CP / EP inside each).

    Args:
        model: this rank's GPTModel, in the mode of the step
            (:func:`megascore.engine.schedule.forward.scoring_forward`).
        microbatches: the step's microbatches, in order.
        spec: what the last stage computes.

    Returns:
        On the last stage, one dict per microbatch (``loss`` and the gathered per-token
        results); an empty list on the other stages.
    """
    pp = model.pg_collection.pp
    seq_length = microbatches[0].packed.input_ids.shape[1]
    schedule = get_forward_backward_func(pp_size=pp.size(), vp_size=None)
    return schedule(
        forward_step_func=functools.partial(forward_step, spec=spec),
        data_iterator=iter(microbatches),
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=1,
        forward_only=True,
    )

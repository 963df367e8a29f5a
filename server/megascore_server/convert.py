"""Domain <-> wire conversion on the output side, and sequence slicing of outputs.

An engine step scores the sequences of several requests at once; the batcher
uses :func:`select_sequences` to cut each request's sequences out of the
step's :class:`ScoreOutput` and :func:`concat_outputs` to put a request's
pieces (possibly from several steps, in any order) back in its own order.
:func:`build_response` then turns a request's output into a ``ScoreResponse``.
"""

from __future__ import annotations

import logging

import numpy as np

from megascore.types import ModelInfo, ScoreBatch, ScoreOutput
from megascore.v1 import scoring_pb2 as pb
from megascore.wire import encode_array

logger = logging.getLogger(__name__)


def offsets_of(lengths: np.ndarray) -> np.ndarray:
    """int64 ``[B+1]`` start offsets of sequences of the given lengths."""
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def token_index(
    offsets: np.ndarray, lengths: np.ndarray, seq_idx: np.ndarray
) -> np.ndarray | slice:
    """Flat token positions of sequences ``seq_idx`` (concatenated in that order).

    Args:
        offsets: ``[B+1]`` offsets of the layout the positions refer to.
        lengths: ``[B]`` lengths of that layout.
        seq_idx: int64 indices of the sequences to take.

    Returns:
        A slice when the sequences are consecutive and ascending, else an int64 array.
    """
    if seq_idx.size and np.array_equal(seq_idx, np.arange(seq_idx[0], seq_idx[0] + seq_idx.size)):
        return slice(int(offsets[seq_idx[0]]), int(offsets[seq_idx[-1] + 1]))
    lens = lengths[seq_idx]
    out_starts = np.cumsum(lens) - lens
    return np.repeat(offsets[seq_idx] - out_starts, lens) + np.arange(int(lens.sum()))


def select_sequences(
    output: ScoreOutput,
    lengths: np.ndarray,
    seq_idx: np.ndarray,
    *,
    top_k: int,
    losses: tuple[str, ...],
    want_logprobs: bool,
) -> ScoreOutput:
    """Cuts sequences ``seq_idx`` of a step's output, trimmed to one request's options.

    Args:
        output: the step's output (layout of ``lengths``).
        lengths: the step's sequence lengths.
        seq_idx: step-sequence indices to take, in the order wanted.
        top_k: the request's k (<= the step's k); top-k columns are sliced to it.
        losses: the request's loss names (a subset of the step's).
        want_logprobs: whether to keep per-token logprobs.

    Returns:
        The output of those sequences only; MoE / MTP metrics are not copied.
    """
    tokens = token_index(offsets_of(lengths), lengths, seq_idx)
    part = ScoreOutput(logprobs=None, weights_version=output.weights_version)
    if want_logprobs:
        part.logprobs = output.logprobs[tokens]
    if top_k > 0:
        part.top_k_ids = output.top_k_ids[tokens, :top_k]
        part.top_k_logprobs = output.top_k_logprobs[tokens, :top_k]
    part.losses = {name: output.losses[name][seq_idx] for name in losses}
    if output.num_loss_tokens is not None:
        part.num_loss_tokens = output.num_loss_tokens[seq_idx]
    return part


def concat_outputs(parts: list[tuple[np.ndarray, ScoreOutput]], lengths: np.ndarray) -> ScoreOutput:
    """Joins pieces of one request into its own sequence order.

    Args:
        parts: ``(request-sequence indices, output of those sequences)`` per piece;
            together the indices cover every sequence exactly once.
        lengths: the request's lengths.

    Returns:
        The request's output in request order (no MoE / MTP metrics).
    """
    if len(parts) == 1 and np.array_equal(parts[0][0], np.arange(lengths.size)):
        return parts[0][1]
    order = np.concatenate([idx for idx, _ in parts])
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    piece_lengths = lengths[order]
    tokens = token_index(offsets_of(piece_lengths), piece_lengths, inverse)

    def join(values: list[np.ndarray | None], index) -> np.ndarray | None:
        if values[0] is None:
            return None
        return np.concatenate(values)[index]

    outs = [out for _, out in parts]
    joined = ScoreOutput(
        logprobs=join([o.logprobs for o in outs], tokens),
        top_k_ids=join([o.top_k_ids for o in outs], tokens),
        top_k_logprobs=join([o.top_k_logprobs for o in outs], tokens),
        losses={k: join([o.losses[k] for o in outs], inverse) for k in outs[0].losses},
        num_loss_tokens=join([o.num_loss_tokens for o in outs], inverse),
        weights_version=outs[-1].weights_version,
    )
    return joined


def count_loss_tokens(batch: ScoreBatch) -> np.ndarray:
    """int64 ``[B]``: masked positions 1..L-1 of each sequence (entry 0 never counts)."""
    if batch.loss_mask is None:
        return batch.lengths - 1
    offsets = batch.offsets()
    sums = np.add.reduceat(batch.loss_mask.astype(np.int64), offsets[:-1])
    return sums - batch.loss_mask[offsets[:-1]].astype(np.int64)


def build_response(
    request_id: str, batch: ScoreBatch, output: ScoreOutput, timings: pb.Timings
) -> pb.ScoreResponse:
    """Builds the ``ScoreResponse`` of one request from its own output.

    Args:
        request_id: echoed as given by the client.
        batch: the request as validated (its options decide what is returned).
        output: the request's output, in its own layout.
        timings: server-side timings.

    Returns:
        The response message.
    """
    response = pb.ScoreResponse(
        request_id=request_id,
        lengths=encode_array(batch.lengths.astype(np.int64, copy=False)),
        weights_version=output.weights_version,
        timings=timings,
    )
    if batch.want_logprobs:
        response.token_logprobs.CopyFrom(
            encode_array(np.asarray(output.logprobs, dtype=np.float32))
        )
    if batch.top_k > 0:
        response.top_k = batch.top_k
        response.top_k_ids.CopyFrom(encode_array(np.asarray(output.top_k_ids, dtype=np.int64)))
        response.top_k_logprobs.CopyFrom(
            encode_array(np.asarray(output.top_k_logprobs, dtype=np.float32))
        )
    for name in batch.losses:
        response.sequence_losses[name].CopyFrom(
            encode_array(np.asarray(output.losses[name], dtype=np.float64))
        )
    num_loss_tokens = output.num_loss_tokens
    if num_loss_tokens is None:
        num_loss_tokens = count_loss_tokens(batch)
    response.num_loss_tokens.CopyFrom(encode_array(np.asarray(num_loss_tokens, dtype=np.int64)))
    if batch.want_moe_metrics:
        response.moe_metrics.update(output.moe_metrics)
    if batch.want_mtp_metrics:
        response.mtp_metrics.update(output.mtp_metrics)
    return response


def model_info_to_proto(
    info: ModelInfo,
    *,
    max_sequence_length: int,
    max_request_tokens: int,
    max_tokens_per_batch: int,
    max_message_bytes: int,
    weights_version: str,
) -> pb.ModelInfo:
    """Converts the engine's :class:`ModelInfo` plus the server's limits to the wire message."""
    p = info.parallel
    return pb.ModelInfo(
        name=info.name,
        architecture=info.architecture,
        num_parameters=info.num_parameters,
        vocab_size=info.vocab_size,
        max_sequence_length=max_sequence_length,
        dtype=info.dtype,
        parallel=pb.ParallelLayout(
            world_size=p.world_size,
            tensor_model_parallel_size=p.tensor_model_parallel_size,
            context_parallel_size=p.context_parallel_size,
            expert_model_parallel_size=p.expert_model_parallel_size,
            pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        ),
        attention_backend=info.attention_backend,
        checkpoint_path=info.checkpoint_path,
        weights_version=weights_version,
        has_tokenizer=info.has_tokenizer,
        max_top_k=info.max_top_k,
        max_request_tokens=max_request_tokens,
        loss_names=list(info.loss_names),
        moe_metric_names=list(info.moe_metric_names),
        mtp_metric_names=list(info.mtp_metric_names),
        max_tokens_per_batch=max_tokens_per_batch,
        max_message_bytes=max_message_bytes,
    )

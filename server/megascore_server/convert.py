"""Domain -> wire codec of the output side: ``ScoreResponse`` and ``ModelInfo`` messages.

Pure conversion: :func:`build_response` encodes one request's
:class:`~megascore.types.ScoreOutput` (already cut out of the engine steps by
the batcher, :mod:`megascore.layout`) as it is; nothing is recomputed here.
The request side (proto -> :class:`~megascore.types.ScoreBatch`) is
``validation.py``, the wire gate.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from megascore.types import ModelInfo, ScoreBatch, ScoreOutput
from megascore.v1 import scoring_pb2 as pb
from megascore.wire import encode_array

logger = logging.getLogger(__name__)


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
    response.num_loss_tokens.CopyFrom(
        encode_array(np.asarray(output.num_loss_tokens, dtype=np.int64))
    )
    if batch.want_moe_metrics:
        response.moe_metrics.update(output.moe_metrics)
    if batch.want_mtp_metrics:
        response.mtp_metrics.update(output.mtp_metrics)
    if batch.want_routing:
        routing = np.asarray(output.routing, dtype=np.int32)  # [T, L, k]
        response.routing.CopyFrom(encode_array(routing))
        response.routing_num_moe_layers, response.routing_topk = routing.shape[1:]
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
    return pb.ModelInfo(
        name=info.name,
        architecture=info.architecture,
        num_parameters=info.num_parameters,
        vocab_size=info.vocab_size,
        max_sequence_length=max_sequence_length,
        dtype=info.dtype,
        parallel=pb.ParallelLayout(**dataclasses.asdict(info.parallel)),
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

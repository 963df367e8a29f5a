"""Domain -> wire codec of the output side: ``ScoreResponse`` and ``ModelInfo`` messages.

Pure conversion: :func:`build_response` encodes one request's
:class:`~megascore.api.types.ScoreOutput` (already cut out of the engine steps by
the batcher, :mod:`megascore.api.layout`) as it is; nothing is recomputed here.
The request side (proto -> :class:`~megascore.api.types.ScoreBatch`) is
``validation.py``, the wire gate.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from megascore.api import schema
from megascore.api.limits import Limits
from megascore.api.types import ModelInfo, ScoreBatch, ScoreOutput
from megascore.api.wire import encode_array
from megascore.v1 import scoring_pb2 as pb

logger = logging.getLogger(__name__)


def build_response(
    request_id: str, batch: ScoreBatch, output: ScoreOutput, timings: pb.Timings
) -> pb.ScoreResponse:
    """Builds the ``ScoreResponse`` of one request from its own output.

    Every output of :data:`megascore.api.schema.OUTPUTS` the request wants goes into its
    wire field, with its trailing shape in the ``wire_dims`` fields.

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
        reference_weights_version=output.reference_weights_version,
        timings=timings,
    )
    for out in schema.OUTPUTS:
        if not out.wanted(batch):
            continue
        value = output.values[out.name]
        if out.keys is not None:
            field = getattr(response, out.wire)
            for key in out.keys(batch):
                field[key].CopyFrom(encode_array(np.asarray(value[key], dtype=out.dtype)))
            continue
        array = np.asarray(value, dtype=out.dtype)
        getattr(response, out.wire).CopyFrom(encode_array(array))
        for name, size in zip(out.wire_dims, array.shape[1:], strict=True):
            setattr(response, name, size)
    if batch.return_moe_metrics:
        response.moe_metrics.update(output.moe_metrics)
    if batch.return_mtp_metrics:
        response.mtp_metrics.update(output.mtp_metrics)
    return response


def model_info_to_proto(
    info: ModelInfo,
    limits: Limits,
    *,
    max_tokens_per_batch: int,
    max_message_bytes: int,
    weights_version: str,
) -> pb.ModelInfo:
    """Converts the engine's :class:`ModelInfo`, the server's :class:`Limits` and its
    step / message sizes to the wire message."""
    return pb.ModelInfo(
        name=info.name,
        architecture=info.architecture,
        num_parameters=info.num_parameters,
        vocab_size=limits.vocab_size,
        max_sequence_length=limits.max_sequence_length,
        dtype=info.dtype,
        parallel=pb.ParallelLayout(**dataclasses.asdict(info.parallel)),
        attention_backend=info.attention_backend,
        checkpoint_path=info.checkpoint_path,
        weights_version=weights_version,
        has_tokenizer=info.has_tokenizer,
        max_top_k=limits.max_top_k,
        max_target_ids=limits.max_target_ids,
        max_request_tokens=limits.max_request_tokens or 0,
        loss_names=list(limits.loss_names),
        moe_metric_names=list(info.moe_metric_names),
        mtp_metric_names=list(info.mtp_metric_names),
        max_tokens_per_batch=max_tokens_per_batch,
        max_message_bytes=max_message_bytes,
        accepts_sequence_groups=True,  # megascore_server.prompt_expansion
        accepts_tensor_chunks=True,  # UpdateWeightsRequest.chunks (push.pusher)
        models=[  # an adapter's slot is the engine's own
            pb.ServedModel(name=m.name, weights_version=m.weights_version, base=m.base)
            for m in info.models
        ],
    )

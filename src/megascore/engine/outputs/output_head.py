"""The LM head of one forward, applied to chunks of rows on demand.

:class:`OutputHead` holds the final hidden states (after the final layernorm) and the
model's output layer, which computes the vocab-parallel logits ``[C, V / tp]`` of any chunk
of rows on demand (the model hands it over from its ``output_processor`` hook:
:mod:`megascore.engine.schedule.packed_inputs`). The full ``[T_local, V / tp]`` logits are never
materialised; :func:`megascore.engine.outputs.logprobs.score_tokens` asks for one chunk at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear

from megascore.engine.outputs.scratch import Scratch
from megascore.model.batch_invariant import is_batch_invariant, pad_rows


@dataclasses.dataclass
class OutputHead:
    """The LM head of one forward, applied to chunks of rows on demand.

    Attributes:
        hidden_states: ``[T_local, 1, H]`` final hidden states (after the final
            layernorm) of this rank's CP shard, in the model's dtype, detached. With
            sequence parallelism they were all-gathered over the TP group (the model
            hands over ``T_local / tp`` rows per rank), so every TP rank holds all rows.
        output_layer: the model's ``ColumnParallelLinear`` (``output_layer``).
        weight: the weight to pass to it: the shared word-embedding weight when
            embeddings are tied, None for the layer's own weight.
        scale_logits: the model's logit scaling (``GPTModel._scale_logits``, MuP).
        scratch: the buffers the head reuses (:func:`head_scratch`; None: new tensors).
    """

    hidden_states: torch.Tensor
    output_layer: torch.nn.Module
    weight: torch.Tensor | None
    scale_logits: Callable[[torch.Tensor], torch.Tensor]
    scratch: Scratch | None = None

    @property
    def num_tokens(self) -> int:
        """``T_local``: rows (packed positions of this CP shard)."""
        return self.hidden_states.shape[0]

    @property
    def vocab_local(self) -> int:
        """``V / tp``: logit columns of this TP rank (Megatron's ``VocabUtility`` slice)."""
        weight = self.output_layer.weight if self.weight is None else self.weight
        return weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.hidden_states.device

    def logits(self, start: int, end: int) -> torch.Tensor:
        """Vocab-parallel logits of rows ``[start, end)``, as Megatron's forward computes them.

        Memory is ``(end - start) x V / tp`` in the model's dtype: callers bound it by
        asking for chunks.

        Args:
            start: first row.
            end: one past the last row.

        Returns:
            ``[end - start, V / tp]`` in the model's dtype; row ``t`` predicts the token
            after packed position ``start + t``.
        """
        # rows: [C, 1, H]; already gathered over TP, so the layer must not gather again
        rows = self.hidden_states[start:end]
        layer = self.output_layer
        if self.scratch is not None and _plain_matmul(layer):
            # what the layer computes (a forward-only ColumnParallelLinear without bias is
            # ``matmul(input, weight.t())``), written into the reused buffer
            weight = layer.weight if self.weight is None else self.weight
            return self.scale_logits(self.matmul(rows[:, 0], weight))
        saved = layer.sequence_parallel
        layer.sequence_parallel = False
        try:
            with torch.no_grad():
                logits, _ = layer(rows, weight=self.weight, runtime_gather_output=False)
        finally:
            layer.sequence_parallel = saved
        return self.scale_logits(logits).squeeze(1)  # [C, V / tp]

    def matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``matmul(x, weight.t())`` for rows ``x [C, H]`` and ``weight [V/tp, H]``: padded
        like the output layer's matmuls when it is batch-invariant
        (:mod:`megascore.model.batch_invariant`), written into the head's reused buffer
        (a new tensor without one). Returns ``[C, V/tp]``."""
        padded = pad_rows(x, weight) if is_batch_invariant(self.output_layer) else x
        if self.scratch is None:
            return torch.matmul(padded, weight.t())[: len(x)]
        out = self.scratch.take("logits", len(padded), weight.shape[0], x.dtype, x.device)
        return torch.matmul(padded, weight.t(), out=out)[: len(x)]


def _plain_matmul(layer: torch.nn.Module) -> bool:
    """Whether the output layer's forward is a plain ``matmul(input, weight.t())``: Megatron's
    local ``ColumnParallelLinear`` (not TransformerEngine's) without a bias; with TP > 1 its
    forward only marks the input for the backward, and the rows were gathered already."""
    return type(layer) is ColumnParallelLinear and layer.bias is None


def head_scratch(output_layer: torch.nn.Module) -> Scratch:
    """The head's reused buffers (:mod:`megascore.engine.outputs.scratch`), kept on the model's
    output layer: they live as long as the model."""
    scratch = output_layer.__dict__.get("_megascore_scratch")
    if scratch is None:
        scratch = output_layer.__dict__["_megascore_scratch"] = Scratch()
    return scratch

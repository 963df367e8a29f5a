"""MTP layers whose MoE routers see the real tokens only: Megatron-Core's
``MultiTokenPredictionLayer`` with a corrected padding mask.

With a ``padding_mask`` (True = pad), Megatron's MTP layer rolls the mask one position
left within each packed sequence, like the token ids, so that position t of the layer
(which embeds token t + 1) is a pad exactly when token t + 1 is. Two cases come out wrong
in Megatron-Core 0.19, and both put pad-dependent positions into the routers' aux-loss
statistics:

* the position rolled in at the end of each sequence is filled with 0 (= a real token),
  although it has no next token: it must count as padding;
* with sequence parallelism the mask arrives scattered over the TP ranks (``T / tp``
  rows each) and is rolled as if it held whole sequences.

:class:`PaddingAwareMTPLayer` gathers the mask over TP first (sequence parallelism),
rolls it with Megatron's own ``roll_tensor`` (packed sequences, context parallelism),
marks the rolled-in positions as padding and scatters it back. Everything else, and
everything without a padding mask, is Megatron's layer.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionLayer,
    roll_tensor,
)


class PaddingAwareMTPLayer(MultiTokenPredictionLayer):
    """``MultiTokenPredictionLayer`` whose rolled padding mask marks each sequence's
    rolled-in last position as padding (see the module docstring)."""

    def _get_embeddings(
        self,
        input_ids,
        position_ids,
        embedding,
        hidden_states,
        packed_seq_params=None,
        padding_mask=None,
    ):
        input_ids, position_ids, _, decoder_input, hidden_states = super()._get_embeddings(
            input_ids=input_ids,
            position_ids=position_ids,
            embedding=embedding,
            hidden_states=hidden_states,
            packed_seq_params=packed_seq_params,
            padding_mask=None,
        )
        if padding_mask is not None:
            padding_mask = self._roll_padding_mask(padding_mask, packed_seq_params)
        return input_ids, position_ids, padding_mask, decoder_input, hidden_states

    def _roll_padding_mask(self, mask: torch.Tensor, packed_seq_params) -> torch.Tensor:
        """``mask`` ``[b, s]`` (``[b, s / tp]`` under sequence parallelism), True = pad."""
        split = self.sequence_parallel and self.tp_group is not None and self.tp_group.size() > 1
        mask = mask.to(torch.int32)  # gloo collectives take no bool
        if split:  # [b, s / tp] -> [s / tp, b] -> gathered [s, b] -> [b, s]
            mask = gather_from_sequence_parallel_region(
                mask.transpose(0, 1).contiguous(), group=self.tp_group
            ).transpose(0, 1)
        kwargs = dict(
            shifts=-1, dims=-1, cp_group=self.cp_group, packed_seq_params=packed_seq_params
        )
        rolled, _ = roll_tensor(mask, **kwargs)
        kept, _ = roll_tensor(torch.ones_like(mask, dtype=torch.int32), **kwargs)
        rolled = (rolled != 0) | (kept == 0)  # the rolled-in position has no next token
        if split:
            rolled = scatter_to_sequence_parallel_region(
                rolled.transpose(0, 1).contiguous(), group=self.tp_group
            ).transpose(0, 1)
        return rolled.contiguous()


def padding_aware_mtp_spec(mtp_block_spec):
    """Copy of an MTP block spec whose layers are :class:`PaddingAwareMTPLayer`."""
    if mtp_block_spec is None:
        return None
    layers = [
        dataclasses.replace(spec, module=PaddingAwareMTPLayer)
        if spec.module is MultiTokenPredictionLayer
        else spec
        for spec in mtp_block_spec.layer_specs
    ]
    return dataclasses.replace(mtp_block_spec, layer_specs=layers)

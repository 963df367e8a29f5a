"""The torch backend's decoder layers read no device value on the host (issue 45).

The packed boundaries stay on the host for the torch backend
(:func:`megascore.engine.schedule.packed_inputs.model_inputs`): Megatron's THD RoPE (a loop over
the sequences with ``.item()``), the core attention's plan and the MTP roll read them in
every layer, and on a GPU each such read of a device tensor is a host sync (~2B+5 per
layer). Proven on the CPU with the ``meta`` device as the model's device: reading a meta
tensor's value raises, so the forward runs only if nothing reads one. The numbers are
the same ops on the same values (the CPU parity tests run this path)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megascore.config import EngineConfig
from megascore.engine.layout.packing import pack_sequences
from megascore.engine.layout.prefix_tree import shared_layout
from megascore.engine.layout.segment_packing import pack_layout
from megascore.engine.schedule.forward import forward_microbatch
from megascore.engine.schedule.packed_inputs import model_inputs
from megascore.model.build import build_model
from megascore.model.config import builtin_model


def _meta_model(pgs, name: str, **changes):
    cfg = dataclasses.replace(builtin_model(name), **changes)
    model = build_model(cfg, EngineConfig(device="cpu"), pgs).to("meta")
    for module in model.modules():  # RoPE's frequencies are a plain attribute
        if isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            module.inv_freq = module.inv_freq.to("meta")
    return model


@pytest.mark.parametrize("lengths", [[5, 17, 9, 30], [64]])
def test_a_packed_forward_reads_no_device_value(pgs, lengths):
    model = _meta_model(pgs, "tiny")
    ids = torch.randint(1, 500, (sum(lengths),))
    packed = pack_sequences(ids.to("meta"), lengths, pad_individual_seqs_to_multiple_of=4)
    out = forward_microbatch(model, packed)  # raises on any host read of a meta tensor
    assert out.hidden_states.device.type == "meta"
    assert out.hidden_states.shape[0] == packed.input_ids.shape[1]
    with pytest.raises(RuntimeError, match="meta"):  # what a host read does here
        packed.cu_seqlens_padded.tolist()


def test_a_shared_prefix_forward_reads_no_device_value(pgs):
    model = _meta_model(pgs, "tiny")
    prompt = torch.randint(1, 500, (24,))
    seqs = [torch.cat([prompt, torch.randint(1, 500, (n,))]) for n in (7, 12, 3)]
    ids = torch.cat(seqs).numpy()
    layout = shared_layout(ids, [len(s) for s in seqs], min_shared=16)
    assert layout.shared
    packed = pack_layout(
        torch.as_tensor(layout.token_ids).to("meta"), layout, pad_multiple=1,
        pad_to=int(layout.lengths.sum()), cp_rank=0, cp_size=1,
    )  # fmt: skip
    out = forward_microbatch(model, packed)
    assert out.hidden_states.device.type == "meta"


def test_the_boundaries_go_to_the_device_for_transformer_engine(pgs):
    model = _meta_model(pgs, "tiny")
    packed = pack_sequences(torch.arange(1, 11).to("meta"), [4, 6])
    host = model_inputs(model, packed)["packed_seq_params"]
    assert host.cu_seqlens_q_padded.device.type == "cpu"
    assert host.cu_seqlens_q_padded.tolist() == [0, 4, 10]
    model.megascore_attention_backend = "te"
    # total_tokens None: Megatron's PackedSeqParams would build Mamba's seq_idx from it
    params = dataclasses.replace(packed.packed_seq_params, total_tokens=None)
    device = model_inputs(model, packed._replace(packed_seq_params=params))["packed_seq_params"]
    assert {device.cu_seqlens_q.device.type, device.cu_seqlens_kv_padded.device.type} == {"meta"}

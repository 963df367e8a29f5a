"""LoRA adapters in a packed forward: the rows (tokens) of one step may belong to different
adapters or to the base model.

:func:`attach` gives a built ``GPTModel`` one :class:`LoraAdapters` registry (kept on the
model, idempotent) and hooks the linear layers an adapter may change: per decoder layer the
attention's ``linear_qkv`` / ``linear_proj`` and, where the layer's MLP is dense, its
``linear_fc1`` / ``linear_fc2`` (Megatron's local spec: ``ColumnParallelLinear`` /
``RowParallelLinear``; a MoE layer's experts, shared experts and router are not hooked).
The registry holds any number of named adapters, each a :class:`LoraWeights` per hooked
layer it changes (already fused and sharded for this rank:
:mod:`megascore.checkpoint.lora_weights` builds them from peft's tensors). A forward
applies them from a per-row adapter index (:meth:`LoraAdapters.rows`): a row of adapter
``a`` gets ``base(x) + (x @ A_a.T) @ B_a.T`` (the scale folded into ``B``), a base row
(-1) gets ``base(x)`` bit for bit, no delta added at all.

Segmented: per adapter present in the forward, its rows are gathered, multiplied by its
two small matrices and added back at their rows (each row once: its own rows read, the
delta added, written back with ``index_copy_``, which is ``index_add_``'s bits without its
scatter, several times slower across threads); no loop over sequences, no forward per
adapter.

Where the rows are: the hook wraps the layer's ``_forward_impl`` (the matmul, before
Megatron's tensor-parallel reduction), as :mod:`megascore.model.batch_invariant` does.
Under sequence parallelism a column-parallel layer's input is this TP rank's share of the
rows; the hook all-gathers it first, as Megatron would inside the matmul, so every hooked
layer sees all of this (CP) rank's packed rows and one index serves every layer. A
row-parallel layer's delta (its ``A`` cut to this rank's input columns) is added to the
partial output before the reduction, so it is summed over TP with the base output.

Batch invariance: when the layer is batch-invariant (``is_batch_invariant``) both small
matmuls run on at least the probed row count (:func:`megascore.model.batch_invariant.pad_rows`),
so a row's delta has the same bits whatever else is in the step, and it is added to the
row's base output once: a sequence scored with its adapter gives the same bits
alone or beside other adapters and the base.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.mlp import MLP

from megascore.model.batch_invariant import is_batch_invariant, min_rows, pad_rows

KINDS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The Megatron layers an adapter may change, per decoder layer."""
ROW_PARALLEL = ("linear_proj", "linear_fc2")
BASE = -1
"""The row index of a row scored with the base weights."""
_ATTR = "megascore_lora"


class LoraWeights(NamedTuple):
    """One adapter's matrices for one hooked layer on this rank (model dtype and device
    once held by :class:`LoraAdapters`).

    Attributes:
        a: ``[R, in_local]``: the parts' ``lora_A`` stacked (R = their ranks summed); a
            row-parallel layer's cut to this rank's input columns.
        b: ``[out_local, R]``: the parts' ``scale * lora_B`` at their rows of this rank's
            (fused) output, zero elsewhere.
    """

    a: torch.Tensor
    b: torch.Tensor


class Target(NamedTuple):
    """A hooked layer: global decoder layer index, kind (:data:`KINDS`), the module."""

    layer: int
    kind: str
    module: torch.nn.Module


def hookable_layers(model: torch.nn.Module) -> dict[tuple[int, str], Target]:
    """``(global layer, kind) -> Target`` of the layers this rank (pipeline stage) holds.

    Raises:
        ValueError: a layer is not one of Megatron's local parallel linears (the
            TransformerEngine spec fuses the norm into ``linear_qkv`` / ``linear_fc1``).
    """
    targets = {}
    decoder = getattr(model, "decoder", None)
    for layer in getattr(decoder, "layers", ()):
        index = layer.layer_number - 1  # global under PP (Megatron adds the stage's offset)
        modules = {k: getattr(layer.self_attention, k, None) for k in KINDS[:2]}
        if isinstance(layer.mlp, MLP):  # dense; a MoE layer is a MoELayer
            modules.update({k: getattr(layer.mlp, k, None) for k in KINDS[2:]})
        for kind, module in modules.items():
            if module is None:  # multi-latent attention: no linear_qkv (adapters refused)
                continue
            if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
                raise ValueError(
                    f"LoRA adapters need Megatron's local linear layers (attention backend "
                    f"'torch'): decoder layer {index}'s {kind} is {type(module).__name__}"
                )
            targets[index, kind] = Target(index, kind, module)
    return targets


class _Hook:
    """A hooked layer's ``_forward_impl``: the base matmul, then the adapters' deltas."""

    def __init__(self, original, adapters: LoraAdapters, target: Target):
        self.original, self.adapters, self.target = original, adapters, target

    def __call__(self, *, input, weight, sequence_parallel=False, tp_group=None, **kwargs):
        active = self.adapters.active(self.target)
        if not active:
            return self.original(
                input=input,
                weight=weight,
                sequence_parallel=sequence_parallel,
                tp_group=tp_group,
                **kwargs,
            )
        if sequence_parallel:  # this TP rank's rows -> all rows, as Megatron's matmul does
            input = gather_from_sequence_parallel_region(input, False, group=tp_group)
        out = self.original(
            input=input, weight=weight, sequence_parallel=False, tp_group=tp_group, **kwargs
        )
        x = input.reshape(-1, input.shape[-1])  # [s, b, in] -> [s * b, in]
        flat = out.view(-1, out.shape[-1])  # a view: the deltas land in ``out``
        self.adapters.check_rows(x.shape[0], weight, self.target)
        invariant = is_batch_invariant(self.target.module)
        for rows, lora in active:
            delta = _low_rank(x.index_select(0, rows), lora, invariant)
            flat.index_copy_(0, rows, flat.index_select(0, rows) + delta)
        return out


def _low_rank(x: torch.Tensor, lora: LoraWeights, invariant: bool) -> torch.Tensor:
    """``(x @ a.T) @ b.T``; batch-invariant: each matmul on at least its probed rows."""
    if not invariant:
        return F.linear(F.linear(x, lora.a), lora.b)
    n = x.shape[0]
    h = F.linear(pad_rows(x, lora.a), lora.a)[:n]  # [n, R]
    return F.linear(pad_rows(h, lora.b), lora.b)[:n]  # [n, out_local]


class LoraAdapters:
    """The named adapters of one model on this rank, and the rows of the forward at hand.

    Each adapter has a slot, a small integer (the lowest one free when it was first
    put), which the per-row index names; :data:`BASE` (-1) is the base model. Use
    :func:`attach` to get a model's registry.
    """

    def __init__(self, model: torch.nn.Module):
        self.targets = hookable_layers(model)
        self._slots: dict[str, int] = {}
        self._weights: dict[int, dict[tuple[int, str], LoraWeights]] = {}
        self._meta: dict[str, object] = {}
        self._groups: list[tuple[int, torch.Tensor]] = []
        self._num_rows = 0
        for target in self.targets.values():
            module = target.module
            module._forward_impl = _Hook(module._forward_impl, self, target)

    @property
    def names(self) -> dict[str, int]:
        """Adapter name -> slot."""
        return dict(self._slots)

    def slot(self, name: str) -> int:
        """The slot of adapter ``name`` (the value its rows take in the row index).

        Raises:
            KeyError: no adapter of that name.
        """
        if name not in self._slots:
            raise KeyError(f"no LoRA adapter {name!r} (adapters: {sorted(self._slots)})")
        return self._slots[name]

    def meta(self, name: str):
        """What :meth:`put` was given as ``meta`` for adapter ``name`` (its config)."""
        self.slot(name)
        return self._meta.get(name)

    def put(self, name: str, weights: dict[tuple[int, str], LoraWeights], meta=None) -> int:
        """Adds adapter ``name``, or replaces all of its weights at once (same slot).

        Args:
            name: the adapter's name.
            weights: ``(global layer, kind) -> LoraWeights`` for layers of
                :attr:`targets` (this rank's); layers not named keep their base output
                for this adapter's rows. Cast to the layer's dtype and device here.
            meta: kept beside the weights (:meth:`meta`), e.g. the adapter's config.

        Returns:
            The adapter's slot.

        Raises:
            ValueError: a layer this rank does not hold, or a shape that does not
                match the layer's local weight (nothing is changed then).
        """
        held = {key: self._held(key, w) for key, w in weights.items()}
        slot = self._slots.get(name)
        if slot is None:
            slot = min(set(range(len(self._slots) + 1)) - set(self._slots.values()))
        self._weights[slot], self._slots[name], self._meta[name] = held, slot, meta
        return slot

    def _held(self, key: tuple[int, str], lora: LoraWeights) -> LoraWeights:
        if key not in self.targets:
            raise ValueError(f"LoRA weights for {key}: this rank holds no such layer")
        weight = self.targets[key].module.weight
        out, inp = weight.shape
        rank = lora.a.shape[0]
        if tuple(lora.a.shape) != (rank, inp) or tuple(lora.b.shape) != (out, rank):
            raise ValueError(
                f"LoRA weights for {key}: a {list(lora.a.shape)}, b {list(lora.b.shape)} do "
                f"not fit the local weight {[out, inp]}"
            )
        cast = dict(dtype=weight.dtype, device=weight.device)
        return LoraWeights(lora.a.to(**cast).contiguous(), lora.b.to(**cast).contiguous())

    def remove(self, name: str) -> None:
        """Drops adapter ``name``; its slot is free for the next new adapter.

        Raises:
            KeyError: no adapter of that name.
        """
        slot = self.slot(name)
        del self._slots[name], self._weights[slot], self._meta[name]
        self._groups = [(s, rows) for s, rows in self._groups if s != slot]

    def set_rows(self, index: torch.Tensor | None) -> None:
        """Sets the adapter of every row for the next forwards (None: all base).

        Args:
            index: int ``[rows]``: one slot (:meth:`slot`) or :data:`BASE` per row the
                model sees on this rank, in its order: the packed rows of this CP rank's
                shard (``[s, b]`` input: ``s * b`` rows, ``s``-major; under sequence
                parallelism all of them, not the TP share). :func:`sequence_rows` builds
                it from per-sequence slots.

        Raises:
            ValueError: a value that is neither -1 nor a held adapter's slot.
        """
        if index is None:
            self._groups, self._num_rows = [], 0
            return
        index = torch.as_tensor(index).reshape(-1).to(torch.long)
        slots = [int(s) for s in torch.unique(index).tolist() if s != BASE]
        unknown = [s for s in slots if s not in self._weights]
        if unknown:
            raise ValueError(
                f"adapter rows name slots {unknown}, which hold no adapter "
                f"(held: {self.names}; {BASE} = base)"
            )
        device = next(iter(self.targets.values())).module.weight.device if self.targets else None
        self._groups = [(s, (index == s).nonzero().flatten().to(device)) for s in slots]
        self._num_rows = index.numel()

    @contextlib.contextmanager
    def rows(self, index: torch.Tensor | None) -> Iterator[LoraAdapters]:
        """:meth:`set_rows` for the block (one forward), all base again after it."""
        self.set_rows(index)
        try:
            yield self
        finally:
            self.set_rows(None)

    def active(self, target: Target) -> list[tuple[torch.Tensor, LoraWeights]]:
        """``(rows, weights)`` of the adapters of this forward that change ``target``."""
        key = (target.layer, target.kind)
        return [
            (rows, self._weights[s][key]) for s, rows in self._groups if key in self._weights[s]
        ]

    def check_rows(self, rows: int, weight: torch.Tensor, target: Target) -> None:
        """Raises ValueError unless a layer's ``rows`` are the index's rows (or, when the
        batch-invariant padding wraps the hook, those rows padded to ``min_rows``)."""
        n = self._num_rows
        padded = is_batch_invariant(target.module) and n < rows == min_rows(weight)
        if rows != n and not padded:
            raise ValueError(
                f"adapter rows: the index has {n} rows, decoder layer {target.layer}'s "
                f"{target.kind} sees {rows}"
            )


def attach(model: torch.nn.Module) -> LoraAdapters:
    """The model's adapter registry, created (and the layers hooked) on the first call.
    Without adapters or rows the hooked layers compute exactly what they did before."""
    adapters = getattr(model, _ATTR, None)
    if adapters is None:
        adapters = LoraAdapters(model)
        setattr(model, _ATTR, adapters)
    return adapters


def sequence_rows(
    slots: torch.Tensor | list[int],
    cu_seqlens_padded: torch.Tensor,
    shard_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """The per-row index of a packed microbatch from one slot per sequence.

    Args:
        slots: ``[B]`` adapter slot (or -1) of each sequence, in packing order;
            segments past them (a padding segment) are base.
        cu_seqlens_padded: ``[segments + 1]`` padded boundaries (``PackedSequences``).
        shard_indices: this CP rank's rows of the full packed axis
            (``PackedSequences.shard_indices``); None: all of them.

    Returns:
        int64 ``[T_local]``: the index :meth:`LoraAdapters.set_rows` takes.
    """
    bounds = torch.as_tensor(cu_seqlens_padded).to("cpu", torch.long)
    lengths = bounds[1:] - bounds[:-1]
    per_segment = torch.full((lengths.numel(),), BASE, dtype=torch.long)
    slots = torch.as_tensor(slots, dtype=torch.long).reshape(-1)
    if slots.numel() > lengths.numel():
        raise ValueError(f"{slots.numel()} slots for {lengths.numel()} packed segments")
    per_segment[: slots.numel()] = slots
    rows = torch.repeat_interleave(per_segment, lengths)
    return rows if shard_indices is None else rows[torch.as_tensor(shard_indices).cpu()]

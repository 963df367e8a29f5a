"""peft LoRA adapters onto a built Megatron ``GPTModel``: the API the engine calls.

* :func:`load_adapter` — adapter ``name`` from a peft directory, for this rank's layers.
* :func:`push_adapter` — adapter ``name`` from a trainer's ``{peft tensor name: tensor}``
  (``get_peft_model_state_dict``), checked as a directory's tensors are; replaces all of
  its tensors at once, nothing changed when a check fails.
* :func:`remove_adapter` — drops it.
* :func:`adapter_weights` — the checks and this rank's weights of an adapter, nothing held.
* The rows of one forward: ``megascore.model.lora.attach(model).rows(index)`` (per-row
  slots; :func:`megascore.model.lora.sequence_rows` from per-sequence ones).

Fused layers take the adapters of their parts exactly (:func:`megatron_lora`): Megatron's
``linear_qkv`` computes q, k and v in one matmul, its output laid out per query group (the
group's q heads, then its k head, then its v head: ``recipes.QKV``), and ``linear_fc1``
computes ``[gate; up]`` (``recipes.GatedFC1``). Their adapter's ``A`` is the parts' ``A``
stacked (rank ``r_q + r_k + r_v``) and its ``B`` the parts' ``scale * B`` block-diagonal,
each part's rows placed at its rows of the fused output, so every output row gets exactly
its part's delta (the other parts' columns are zero). Tensor parallelism cuts them as the
base weights are cut: a column-parallel layer keeps the ``B`` rows of this rank's output
rows (its query groups; its gate and up rows), a row-parallel one (``linear_proj``,
``linear_fc2``) the ``A`` columns of its input columns, its delta summed over TP with the
base output. Pipeline stages hold their own layers' adapters only.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from megascore.api.errors import CheckpointError
from megascore.checkpoint.peft_adapter import (
    AdapterConfig,
    ModuleLora,
    parse_adapter,
    read_adapter_dir,
)
from megascore.checkpoint.recipes import ParallelRanks
from megascore.model.config import ModelConfig
from megascore.model.lora import ROW_PARALLEL, LoraWeights, attach

PARTS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
"""Megatron layer -> the HF modules it computes, in their order in its output."""
PUSHED = "pushed adapter tensors"


def _shard(total: int, ranks: ParallelRanks) -> tuple[int, int]:
    per = total // ranks.tp_size
    return ranks.tp_rank * per, (ranks.tp_rank + 1) * per


class _Rows(NamedTuple):
    """Where one part's ``B`` rows go in a column-parallel layer's local fused output, seen
    as ``[groups, stride]`` rows: group ``g``'s ``width`` rows are the part's rows from
    ``first + g * width`` on, placed from row ``offset`` of the group (slices, no index)."""

    groups: int
    stride: int
    first: int
    width: int
    offset: int


def _qkv_rows(cfg: ModelConfig, ranks: ParallelRanks) -> list[_Rows]:
    """Per part (q, k, v): its rows this rank keeps and their rows in the local fused
    output ``[local groups, (heads per group + 2) * d]``."""
    d, groups = cfg.kv_channels, cfg.num_query_groups
    hpg = cfg.num_attention_heads // groups
    g0, g1 = _shard(groups, ranks)
    stride = (hpg + 2) * d
    return [
        _Rows(g1 - g0, stride, g0 * width, width, offset)
        for width, offset in ((hpg * d, 0), (d, hpg * d), (d, (hpg + 1) * d))
    ]


def _fc1_rows(cfg: ModelConfig, ranks: ParallelRanks) -> list[_Rows]:
    """Per part (gate, up): this rank's rows, then their rows of ``[gate_local; up_local]``."""
    f0, f1 = _shard(cfg.ffn_hidden_size, ranks)
    n = f1 - f0
    return [_Rows(1, 2 * n, f0, n, 0), _Rows(1, 2 * n, f0, n, n)]


def _column_parallel(parts, rows: list[_Rows], out_local: int) -> LoraWeights:
    """``A`` stacked, ``B`` block-diagonal at the parts' local output rows (absent parts:
    no columns)."""
    present = [(p, r) for p, r in zip(parts, rows, strict=True) if p is not None]
    a = torch.cat([p.a.float() for p, _ in present])
    b = a.new_zeros(out_local, a.shape[0])
    col = 0
    for part, at in present:
        r = part.a.shape[0]
        src = part.b.float()[at.first : at.first + at.groups * at.width] * part.scale
        fused = b.view(at.groups, at.stride, b.shape[1])
        fused[:, at.offset : at.offset + at.width, col : col + r] = src.view(at.groups, at.width, r)
        col += r
    return LoraWeights(a, b)


def _row_parallel(part: ModuleLora, ranks: ParallelRanks) -> LoraWeights:
    """``A``'s columns of this rank's input shard (a copy: a pushed ``A`` is a view of the
    server's pooled buffer); ``scale * B`` whole."""
    c0, c1 = _shard(part.a.shape[1], ranks)
    return LoraWeights(part.a.float()[:, c0:c1].clone(), part.b.float() * part.scale)


def megatron_lora(
    modules: dict[tuple[int, str], ModuleLora],
    cfg: ModelConfig,
    layers,
    ranks: ParallelRanks,
) -> dict[tuple[int, str], LoraWeights]:
    """An adapter's HF modules as this rank's Megatron layers' weights (float32).

    Args:
        modules: ``(layer, HF module) -> ModuleLora`` (:func:`parse_adapter`).
        cfg: the model's architecture.
        layers: the ``(global layer, kind)`` this rank holds
            (``LoraAdapters.targets``).
        ranks: this rank's tensor-parallel rank and size.

    Returns:
        ``(global layer, kind) -> LoraWeights`` for the held layers the adapter changes.
    """
    rows = {"linear_qkv": _qkv_rows(cfg, ranks), "linear_fc1": _fc1_rows(cfg, ranks)}
    out_local = {
        "linear_qkv": (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.kv_channels,
        "linear_fc1": 2 * cfg.ffn_hidden_size,
    }
    weights = {}
    for layer, kind in layers:
        parts = [modules.get((layer, m)) for m in PARTS[kind]]
        if all(p is None for p in parts):
            continue
        if kind in ROW_PARALLEL:
            weights[layer, kind] = _row_parallel(parts[0], ranks)
        else:
            local = out_local[kind] // ranks.tp_size
            weights[layer, kind] = _column_parallel(parts, rows[kind], local)
    return weights


def put_adapter(
    model: torch.nn.Module,
    cfg: ModelConfig,
    name: str,
    tensors: dict[str, torch.Tensor],
    config: AdapterConfig,
    source: str = PUSHED,
) -> int:
    """Checks peft tensors against the model and holds them as adapter ``name`` (new, or
    every tensor of an existing one replaced at once: a layer it no longer names goes
    back to the base for its rows).

    Args:
        model: the built ``GPTModel`` of this rank (local linear layers).
        cfg: its architecture.
        name: the adapter's name.
        tensors: peft tensor name -> tensor (every ``lora_A`` with its ``lora_B``).
        config: the adapter's config (ranks, alphas, rsLoRA).
        source: the file or origin named in errors.

    Returns:
        The adapter's slot (the value of its rows in the per-row index).

    Raises:
        CheckpointError: a refused, unknown or misshapen tensor (named with ``source``),
            or no LoRA tensor at all; the adapter is then left as it was.
    """
    return attach(model).put(name, adapter_weights(model, cfg, tensors, config, source), config)


def adapter_weights(
    model: torch.nn.Module,
    cfg: ModelConfig,
    tensors: dict[str, torch.Tensor],
    config: AdapterConfig,
    source: str = PUSHED,
) -> dict[tuple[int, str], LoraWeights]:
    """Checks peft tensors against the model and makes this rank's layers' weights of them,
    changing nothing (what :func:`put_adapter` holds; the engine agrees over its ranks in
    between, ``megascore.engine.weights.adapters``).

    Raises:
        CheckpointError: as :func:`put_adapter`.
    """
    modules = parse_adapter(config, tensors, cfg, source)
    if not modules:
        raise CheckpointError(f"{source}: no LoRA tensor")
    return megatron_lora(modules, cfg, attach(model).targets, ParallelRanks.from_model(model))


def load_adapter(model: torch.nn.Module, cfg: ModelConfig, name: str, path: str | Path) -> int:
    """Loads the peft adapter saved in ``path`` (``adapter_config.json`` +
    ``adapter_model.safetensors``) as adapter ``name`` of ``model`` on this rank.

    Every rank of the replica calls it with the same arguments; each keeps its layers'
    shards. Loading a name that exists replaces that adapter.

    Returns:
        The adapter's slot.

    Raises:
        CheckpointError: a missing file, a refused option or tensor, a shape that does
            not fit the model (all named).
    """
    config, tensors, source = read_adapter_dir(path)
    return put_adapter(model, cfg, name, tensors, config, source)


def push_adapter(
    model: torch.nn.Module,
    cfg: ModelConfig,
    name: str,
    tensors: dict[str, torch.Tensor],
    config: AdapterConfig | dict | None = None,
) -> int:
    """Replaces adapter ``name``'s tensors with a trainer's (a weight push).

    Args:
        model: the built ``GPTModel`` of this rank.
        cfg: its architecture.
        name: the adapter; it must exist unless ``config`` is given.
        tensors: the adapter's whole state dict, peft names (``get_peft_model_state_dict``
            or the peft model's ``state_dict()`` LoRA entries), full (unsharded) tensors.
        config: an ``AdapterConfig`` or ``adapter_config.json`` object; None keeps the
            config the adapter was loaded with.

    Returns:
        The adapter's slot (unchanged for an existing adapter).

    Raises:
        CheckpointError: as :func:`put_adapter`, or no config for a new adapter.
    """
    if isinstance(config, dict):
        config = AdapterConfig.from_dict(config, PUSHED)
    if config is None:
        adapters = attach(model)
        if name not in adapters.names:
            raise CheckpointError(f"{PUSHED}: adapter {name!r} is new and no config came with it")
        config = adapters.meta(name)
    return put_adapter(model, cfg, name, tensors, config)


def remove_adapter(model: torch.nn.Module, name: str) -> None:
    """Drops adapter ``name`` from ``model`` (KeyError when it has none of that name)."""
    attach(model).remove(name)

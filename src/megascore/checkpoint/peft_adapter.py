"""Reading and checking a peft LoRA adapter: ``adapter_config.json`` +
``adapter_model.safetensors``, or a trainer's pushed ``{peft tensor name: tensor}``.

What is read: ``r``, ``lora_alpha``, ``use_rslora`` (scale ``alpha / sqrt(r)`` instead of
``alpha / r``), ``rank_pattern`` / ``alpha_pattern`` (per module, matched as peft matches
them, :func:`pattern_value`), ``target_modules`` (a list, or a regex string: the tensors
say which modules carry an adapter). Supported modules: the attention projections
``q_proj k_proj v_proj o_proj`` and the dense MLP's ``gate_proj up_proj down_proj`` of a
decoder layer (a MoE layer's experts, shared experts and router are not). Everything else
is refused by name with a :class:`~megascore.api.errors.CheckpointError` (the error of a
bad checkpoint): DoRA, LoRA biases, ``modules_to_save``, trainable tokens, adapters on
MoE experts (peft's ``target_parameters``: its tensors name the experts), on the
embeddings or on the output layer, a tensor whose shape does not fit the model (named
with its file), a missing file.

:func:`parse_adapter` returns one :class:`ModuleLora` per adapted HF module; how they
land on Megatron's fused layers is :mod:`megascore.checkpoint.lora_weights`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import torch

from megascore.api.errors import CheckpointError
from megascore.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
DENSE_MLP = ("gate_proj", "up_proj", "down_proj")
SUPPORTED = ATTENTION + DENSE_MLP
"""The HF module names an adapter may target (decoder layers only)."""

_TENSOR = re.compile(
    r"(?P<key>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<module>[A-Za-z_]\w*))"
    r"\.lora_(?P<ab>[AB])(?:\.[A-Za-z_]\w*)?\.weight"
)
"""A LoRA tensor of a decoder layer's module: ``...layers.{i}.{self_attn|mlp}.{module}.
lora_{A|B}[.{adapter name}].weight`` (peft's files drop the adapter name; a model's own
``state_dict()`` keeps it)."""
_PEFT_PREFIX = "base_model.model."

_REFUSED_FIELDS = (  # config field, the value that means "off", what it is
    ("use_dora", False, "DoRA (use_dora)"),
    ("bias", "none", "LoRA biases (bias)"),
    ("lora_bias", False, "a bias on lora_B (lora_bias)"),
    ("modules_to_save", None, "modules_to_save (fully trained copies of modules)"),
    ("trainable_token_indices", None, "trainable tokens (trainable_token_indices)"),
    ("fan_in_fan_out", False, "fan_in_fan_out (Conv1D weights)"),
    ("layer_replication", None, "layer_replication"),
    ("alora_invocation_tokens", None, "activated LoRA (alora_invocation_tokens)"),
    ("use_qalora", False, "QA-LoRA (use_qalora)"),
    ("use_bdlora", None, "block-diagonal LoRA (use_bdlora)"),
    ("arrow_config", None, "Arrow routing (arrow_config)"),
)
_REFUSED_TENSORS = (  # a part of a refused tensor's name, why
    ("lora_magnitude_vector", "DoRA magnitudes (use_dora) are not supported"),
    ("modules_to_save", "modules_to_save is not supported"),
    ("lora_embedding", "adapters on the embeddings are not supported"),
    ("embed_tokens", "adapters on the embeddings are not supported"),
    ("lm_head", "adapters on the output layer (lm_head) are not supported"),
    ("expert", "adapters on MoE experts are not supported"),
    (".mlp.gate.", "adapters on the MoE router (mlp.gate) are not supported"),
    ("lora_bias", "LoRA biases are not supported"),
    ("token_adapter", "trainable tokens are not supported"),
)


def _off(value, off) -> bool:
    """Whether a config value means the option is off (None / False: any empty value)."""
    return value == off or (off in (None, False) and not value)


def pattern_value(patterns: dict, key: str, default):
    """peft's per-module value: the first pattern ``p`` of ``patterns`` (in order) with
    ``re.match(rf"(.*\\.)?({p})$", key)`` gives its value (peft ``get_pattern_key``),
    else ``default``."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """The fields of a peft ``LoraConfig`` that change the numbers of a LoRA forward.

    Attributes:
        r: default rank.
        lora_alpha: default alpha.
        use_rslora: scale ``alpha / sqrt(r)`` (rank-stabilised) instead of ``alpha / r``.
        rank_pattern: module-name pattern -> rank (peft's ``rank_pattern``).
        alpha_pattern: module-name pattern -> alpha (peft's ``alpha_pattern``).
        target_modules: the config's targets (a list, or a regex string), for reference.
    """

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict = dataclasses.field(default_factory=dict)
    alpha_pattern: dict = dataclasses.field(default_factory=dict)
    target_modules: tuple[str, ...] | str | None = None

    @classmethod
    def from_dict(cls, data: dict, source: str = CONFIG_FILE) -> AdapterConfig:
        """A peft ``adapter_config.json`` object, checked.

        Raises:
            CheckpointError: not a LoRA config, a refused option (named), or a target
                module other than those of :data:`SUPPORTED` named in a list.
        """
        if data.get("peft_type", "LORA") != "LORA":
            raise CheckpointError(f"{source}: peft_type {data.get('peft_type')!r} is not LORA")
        for field, off, what in _REFUSED_FIELDS:
            if not _off(data.get(field, off), off):
                raise CheckpointError(
                    f"{source}: {what} is not supported ({field} = {data[field]!r})"
                )
        targets = data.get("target_modules")
        if isinstance(targets, list | tuple):
            refused = [t for t in targets if t.rsplit(".", 1)[-1] not in SUPPORTED]
            if refused:
                raise CheckpointError(
                    f"{source}: target_modules {refused} are not supported (LoRA on "
                    f"{', '.join(SUPPORTED)} of decoder layers only; dense MLPs, not experts)"
                )
            targets = tuple(targets)
        try:
            return cls(
                r=int(data["r"]),
                lora_alpha=float(data["lora_alpha"]),
                use_rslora=bool(data.get("use_rslora", False)),
                rank_pattern=dict(data.get("rank_pattern") or {}),
                alpha_pattern=dict(data.get("alpha_pattern") or {}),
                target_modules=targets,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: not a LoRA config ({type(e).__name__}: {e})") from e

    def rank(self, key: str) -> int:
        """The rank of module ``key`` (peft's module name, e.g.
        ``model.layers.0.self_attn.q_proj``)."""
        return int(pattern_value(self.rank_pattern, key, self.r))

    def scale(self, key: str) -> float:
        """``alpha / r`` of module ``key`` (``alpha / sqrt(r)`` with rsLoRA), as peft."""
        alpha, r = float(pattern_value(self.alpha_pattern, key, self.lora_alpha)), self.rank(key)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


@dataclasses.dataclass(frozen=True)
class ModuleLora:
    """One HF module's adapter: ``delta(x) = scale * (x @ a.T) @ b.T``.

    Attributes:
        layer: global decoder layer index.
        module: HF module name (one of :data:`SUPPORTED`).
        a: ``[r, in]`` (peft's ``lora_A.weight``).
        b: ``[out, r]`` (peft's ``lora_B.weight``).
        scale: ``alpha / r`` or ``alpha / sqrt(r)``.
    """

    layer: int
    module: str
    a: torch.Tensor
    b: torch.Tensor
    scale: float


def read_adapter_dir(path: str | Path) -> tuple[AdapterConfig, dict[str, torch.Tensor], str]:
    """Reads what peft's ``save_pretrained`` wrote.

    Returns:
        ``(config, {tensor name: tensor}, the weights file's path)``.

    Raises:
        CheckpointError: the directory, ``adapter_config.json`` or
            ``adapter_model.safetensors`` is missing or unreadable (named), or the
            config refuses (:meth:`AdapterConfig.from_dict`).
    """
    from safetensors.torch import load_file

    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such adapter directory")
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: missing (not a peft adapter directory)")
    if not weights_path.is_file():
        legacy = " (adapter_model.bin is not read: save with safe_serialization)"
        bin_there = (directory / "adapter_model.bin").is_file()
        raise CheckpointError(f"{weights_path}: missing{legacy if bin_there else ''}")
    try:
        data = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{config_path}: unreadable ({e})") from e
    config = AdapterConfig.from_dict(data, str(config_path))
    try:
        tensors = load_file(str(weights_path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"{weights_path}: unreadable ({type(e).__name__}: {e})") from e
    return config, tensors, str(weights_path)


def _refusal(name: str, module: str | None = None) -> str:
    """Why tensor ``name`` (of HF module ``module``, when it parsed) is refused."""
    for part, why in _REFUSED_TENSORS:
        if part in name:
            return why
    what = f"module {module!r} is" if module else "not a LoRA tensor of"
    return f"{what} not one of {', '.join(SUPPORTED)} of a decoder layer's self_attn / mlp"


def expected_shape(model_cfg: ModelConfig, module: str) -> tuple[int, int]:
    """``(out, in)`` of HF module ``module`` in ``model_cfg``'s decoder layers."""
    c = model_cfg
    h, d, ffn = c.hidden_size, c.kv_channels, c.ffn_hidden_size
    return {
        "q_proj": (c.num_attention_heads * d, h),
        "k_proj": (c.num_query_groups * d, h),
        "v_proj": (c.num_query_groups * d, h),
        "o_proj": (h, c.num_attention_heads * d),
        "gate_proj": (ffn, h),
        "up_proj": (ffn, h),
        "down_proj": (h, ffn),
    }[module]


def push_targets(config: AdapterConfig, model_cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Every peft tensor name a push of an adapter of ``config`` may carry, with its shape
    (``get_peft_model_state_dict`` names: ``base_model.model.model.layers.{i}.self_attn.
    q_proj.lora_A.weight``): both matrices of every supported module of every layer."""
    targets = {}
    for layer in range(model_cfg.num_layers):
        modules = [] if model_cfg.multi_latent_attention else list(ATTENTION)
        modules += list(DENSE_MLP) if dense_mlp(model_cfg, layer) else []
        for module in modules:
            block = "self_attn" if module in ATTENTION else "mlp"
            key = f"model.layers.{layer}.{block}.{module}"
            r, (out, inp) = config.rank(key), expected_shape(model_cfg, module)
            targets[f"{_PEFT_PREFIX}{key}.lora_A.weight"] = (r, inp)
            targets[f"{_PEFT_PREFIX}{key}.lora_B.weight"] = (out, r)
    return targets


def dense_mlp(model_cfg: ModelConfig, layer: int) -> bool:
    """Whether decoder layer ``layer`` has a dense MLP (not a MoE layer): Megatron's
    ``moe_layer_freq`` (an int k: layers ``i % k == 0`` are MoE; a list: 1 = MoE)."""
    if not model_cfg.is_moe:
        return True
    freq = model_cfg.moe_layer_freq
    return not (freq[layer] if isinstance(freq, list) else layer % freq == 0)


def _check_module(model_cfg: ModelConfig, name: str, layer: int, module: str, source: str):
    def refuse(why: str):
        raise CheckpointError(f"{source}: tensor {name!r}: {why}")

    if module not in SUPPORTED:
        refuse(_refusal(name, module))
    if layer >= model_cfg.num_layers:
        refuse(f"layer {layer} is past the model's {model_cfg.num_layers} decoder layers")
    if module in ATTENTION and model_cfg.multi_latent_attention:
        refuse("adapters on multi-latent attention are not supported")
    if module in DENSE_MLP and not dense_mlp(model_cfg, layer):
        refuse(f"layer {layer}'s MLP is a MoE layer (adapters on experts are not supported)")


def parse_adapter(
    config: AdapterConfig,
    tensors: dict[str, torch.Tensor],
    model_cfg: ModelConfig,
    source: str,
) -> dict[tuple[int, str], ModuleLora]:
    """Checks an adapter's tensors against the model and pairs them per module.

    Args:
        config: the adapter's config.
        tensors: peft tensor name (``base_model.model.model.layers.0.self_attn.q_proj.
            lora_A.weight``, or with the adapter name before ``.weight``) -> tensor.
        model_cfg: the model the adapter is for.
        source: the file (or "pushed adapter tensors") named in errors.

    Returns:
        ``(global layer, HF module name) -> ModuleLora``.

    Raises:
        CheckpointError: a refused or unknown tensor, an A without its B (or the
            reverse), a rank other than the config's, or a shape that does not fit the
            model; the tensor and ``source`` are named.
    """
    parts: dict[tuple[int, str], dict] = {}
    for name, tensor in tensors.items():
        m = _TENSOR.fullmatch(name)
        if m is None:
            raise CheckpointError(f"{source}: tensor {name!r}: {_refusal(name)}")
        layer, module = int(m["layer"]), m["module"]
        _check_module(model_cfg, name, layer, module, source)
        key = m["key"].removeprefix(_PEFT_PREFIX)
        entry = parts.setdefault((layer, module), {"key": key})
        if m["ab"] in entry:
            raise CheckpointError(f"{source}: tensor {name!r}: a second lora_{m['ab']} of {key}")
        entry[m["ab"]] = (name, tensor)
    out = {}
    for (layer, module), entry in sorted(parts.items()):
        out[layer, module] = _module_lora(config, model_cfg, layer, module, entry, source)
    return out


def _module_lora(config, model_cfg, layer, module, entry, source) -> ModuleLora:
    """One module's A and B, their shapes checked against the rank and the model."""
    key = entry["key"]
    for ab in "AB":
        if ab not in entry:
            have = entry["B" if ab == "A" else "A"][0]
            raise CheckpointError(f"{source}: {have!r} has no lora_{ab} beside it")
    (a_name, a), (b_name, b) = entry["A"], entry["B"]
    r, (out, inp) = config.rank(key), expected_shape(model_cfg, module)
    for name, tensor, want in ((a_name, a, (r, inp)), (b_name, b, (out, r))):
        if tuple(tensor.shape) != want:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {list(tensor.shape)}, expected "
                f"{list(want)} (rank {r} from the adapter config, {module} of the model "
                f"[{out}, {inp}])"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(f"{source}: tensor {name!r} has dtype {tensor.dtype}")
    return ModuleLora(layer, module, a, b, config.scale(key))

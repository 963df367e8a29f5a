"""Builds a Megatron-Core ``GPTModel`` from a :class:`ModelConfig` and an :class:`EngineConfig`.

Call :func:`megascore.model.parallel.initialize_parallel` first; :func:`build_model`
then returns a model in eval mode with deterministic, layout-independent
weights (see ``megascore.model.weights``) and no parameter requiring grad, or, when
a checkpoint's weights follow (``random_weights=False``), with its parameters
allocated but never written: no random number is drawn (Megatron's
``perform_initialization`` is off in every case) and on the CPU the untouched
pages cost no memory until the loader writes them.

Attention backends:

* ``"te"``: TransformerEngine layer spec (``TEDotProductAttention``; THD and
  context parallelism handled by TE). Needs TE importable and CUDA.
* ``"torch"``: Megatron's local layer spec with
  :class:`megascore.model.attention.TorchCoreAttention` as core attention.
  Runs anywhere, including the CPU (with ``megascore.model.cpu_compat``).
* ``"auto"``: ``"te"`` when TE is available, the device is CUDA and the dtype is
  bfloat16 / float16 (TE has no float32 THD attention), else ``"torch"``.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.extensions.transformer_engine import HAVE_TE as _MCORE_HAVE_TE
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megascore.config import EngineConfig
from megascore.model import cpu_compat
from megascore.model.attention import TorchCoreAttention
from megascore.model.config import ModelConfig
from megascore.model.mla import mla_layer_spec
from megascore.model.mtp import padding_aware_mtp_spec
from megascore.model.parallel import pipeline_layer_split, resolve_device
from megascore.model.weights import initialize_weights

try:
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
except ImportError:  # apex missing
    FusedLayerNorm = None

logger = logging.getLogger(__name__)

HAVE_TE = bool(_MCORE_HAVE_TE)
"""Whether TransformerEngine is importable (it needs CUDA)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _te_error() -> str:
    """Why TransformerEngine does not import (Megatron's ``HAVE_TE`` hides the reason)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or TE not finding CUDA libraries
        return f"{type(e).__name__}: {e}"
    return "megatron.core.extensions.transformer_engine.HAVE_TE is False"


def resolve_attention_backend(engine_cfg: EngineConfig, device: torch.device) -> str:
    """Picks the attention backend (the start-up check of ``--attention-backend``).

    ``"auto"`` is ``"te"`` only where TransformerEngine can run the packed (THD)
    attention: TE importable (``HAVE_TE``), a CUDA device and a bfloat16 / float16
    model (TE's fused and flash attention have no float32 kernel; its float32 path
    refuses THD up to TE 2.10 and context parallelism in every version). Otherwise
    ``"torch"``. An explicit ``"te"`` that cannot run fails here, at start-up, rather
    than at the first request.

    Args:
        engine_cfg: requested backend ("auto", "te" or "torch") and dtype.
        device: the model's device.

    Returns:
        "te" or "torch".

    Raises:
        ValueError: "te" requested without TransformerEngine, without CUDA or in float32.
    """
    half = engine_cfg.dtype in ("bfloat16", "float16")
    if engine_cfg.attention_backend == "auto":
        if device.type == "cuda" and half and not HAVE_TE:
            logger.warning("TransformerEngine is not importable (%s): torch attention", _te_error())
        return "te" if HAVE_TE and device.type == "cuda" and half else "torch"
    if engine_cfg.attention_backend == "te":
        if not HAVE_TE:
            raise ValueError(
                f"attention_backend 'te': TransformerEngine is not importable ({_te_error()}; "
                "it comes with the NGC PyTorch image); use --attention-backend torch"
            )
        if device.type != "cuda":
            raise ValueError(f"attention_backend 'te' needs a CUDA device, not {device}")
        if not half:
            raise ValueError(
                f"attention_backend 'te' needs dtype bfloat16 or float16, not {engine_cfg.dtype}"
            )
    return engine_cfg.attention_backend


def _moe_fields(model_cfg: ModelConfig, engine_cfg: EngineConfig) -> dict:
    """The ``TransformerConfig`` fields of a MoE model: its router, dropless experts and
    routing replay."""
    return dict(
        num_moe_experts=model_cfg.num_moe_experts,
        moe_router_topk=model_cfg.moe_router_topk,
        moe_ffn_hidden_size=model_cfg.moe_ffn_hidden_size or model_cfg.ffn_hidden_size,
        moe_router_score_function=model_cfg.moe_router_score_function,
        moe_router_pre_softmax=model_cfg.moe_router_pre_softmax,
        moe_router_load_balancing_type=model_cfg.moe_router_load_balancing_type,
        moe_aux_loss_coeff=model_cfg.moe_aux_loss_coeff,
        moe_z_loss_coeff=model_cfg.moe_z_loss_coeff,
        moe_shared_expert_intermediate_size=model_cfg.moe_shared_expert_intermediate_size,
        moe_layer_freq=model_cfg.moe_layer_freq,
        moe_router_enable_expert_bias=model_cfg.moe_router_enable_expert_bias,
        moe_router_num_groups=model_cfg.moe_router_num_groups,
        moe_router_group_topk=model_cfg.moe_router_group_topk,
        moe_router_topk_scaling_factor=model_cfg.moe_router_topk_scaling_factor,
        moe_router_dtype=engine_cfg.router_dtype_for(model_cfg.moe_router_dtype),
        moe_expert_capacity_factor=None,
        # each EP rank sends its tokens to the experts' ranks and back (the data-parallel
        # ranks score different sequences: megascore.engine.schedule.data_parallel); the CPU
        # overrides select "allgather" (alltoall creates CUDA streams)
        moe_token_dispatcher_type="alltoall",
        # Every router gets a RouterReplay (megascore.engine.outputs.routing); idle unless a
        # request records or replays routes.
        moe_enable_routing_replay=True,
    )


def make_transformer_config(
    model_cfg: ModelConfig, engine_cfg: EngineConfig, device: torch.device, backend: str = "torch"
) -> TransformerConfig:
    """Maps the model and engine configs onto Megatron's ``TransformerConfig``.

    Dropout is off, MoE is dropless (no capacity factor: a token's result never
    depends on the rest of the batch) with routing replay enabled, weights are
    initialised by megascore.
    Sequence parallelism follows ``engine_cfg.sequence_parallel_for`` (on by default
    for a MoE model with TP > 1).

    Args:
        model_cfg: architecture.
        engine_cfg: parallel sizes and dtype.
        device: the model's device (CPU adds ``cpu_compat`` overrides).
        backend: the attention backend ("te" adds :func:`te_fusions`).

    Returns:
        The transformer config.
    """
    dtype = _DTYPES[engine_cfg.dtype]
    kwargs = dict(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups,
        kv_channels=model_cfg.kv_channels,
        ffn_hidden_size=model_cfg.ffn_hidden_size,
        normalization=model_cfg.normalization,
        layernorm_epsilon=model_cfg.layernorm_epsilon,
        gated_linear_unit=model_cfg.gated_linear_unit,
        activation_func=F.silu if model_cfg.activation == "silu" else F.gelu,
        add_bias_linear=model_cfg.add_bias_linear,
        add_qkv_bias=model_cfg.add_qkv_bias,
        qk_layernorm=model_cfg.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model_cfg.init_method_std,
        perform_initialization=False,
        use_cpu_initialization=device.type == "cpu",
        tensor_model_parallel_size=engine_cfg.tensor_model_parallel_size,
        context_parallel_size=engine_cfg.context_parallel_size,
        expert_model_parallel_size=engine_cfg.expert_model_parallel_size,
        sequence_parallel=engine_cfg.sequence_parallel_for(model_cfg.is_moe),
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        calculate_per_token_loss=False,
        **_pipeline_kwargs(model_cfg.num_layers, engine_cfg.pipeline_model_parallel_size),
    )
    if model_cfg.is_moe:
        kwargs.update(_moe_fields(model_cfg, engine_cfg))
    if model_cfg.has_mtp:
        kwargs.update(
            mtp_num_layers=model_cfg.mtp_num_layers,
            mtp_loss_scaling_factor=model_cfg.mtp_loss_scaling_factor,
        )
    if engine_cfg.context_parallel_size > 1:
        kwargs["cp_comm_type"] = "p2p"
    if backend == "te":
        kwargs.update(te_fusions(model_cfg))
    if device.type == "cpu":
        overrides = cpu_compat.transformer_config_overrides()
        if not model_cfg.is_moe:
            overrides = {k: v for k, v in overrides.items() if not k.startswith("moe_")}
        kwargs.update(overrides)
    if model_cfg.multi_latent_attention:
        return MLATransformerConfig(**kwargs, **_mla_fields(model_cfg))
    return TransformerConfig(**kwargs)


def te_fusions(model_cfg: ModelConfig) -> dict:
    """``TransformerConfig`` fields of the TE backend's fused kernels.

    * ``apply_rope_fusion``: TE's fused RoPE; on packed (THD) input one kernel per layer
      that reads the sequence boundaries on the device, where the unfused path splits the
      packed sequence on the host in every layer (a device sync each). Not for multi-latent
      attention (Megatron-Core 0.19 supports its fused MLA RoPE in training only).
    * ``moe_grouped_gemm``: the experts as TE's ``TEGroupedMLP`` (one grouped GEMM over a
      rank's local experts instead of one GEMM per expert); its ``linear_fc1.weight{i}``
      names load from the same tensors as ``local_experts.{i}.linear_fc1.weight``
      (``megascore.checkpoint.hf_names``, ``megascore.model.weights.canonical_name``).
    """
    return {
        "apply_rope_fusion": not model_cfg.multi_latent_attention,
        "moe_grouped_gemm": bool(model_cfg.is_moe),
    }


def _pipeline_kwargs(num_layers: int, pp: int) -> dict:
    """Megatron's pipeline fields: stage count and uneven first / last stage sizes.

    ``variable_seq_lengths`` stays off (Megatron refuses it with the allgather MoE
    dispatcher): the engine pads every microbatch of a step to one packed length.
    """
    if pp == 1:
        return {}
    kwargs = dict(pipeline_model_parallel_size=pp)
    split = pipeline_layer_split(num_layers, pp)
    if split is not None:
        kwargs.update(
            num_layers_in_first_pipeline_stage=split[0], num_layers_in_last_pipeline_stage=split[1]
        )
    return kwargs


def _mla_fields(model_cfg: ModelConfig) -> dict:
    """``MLATransformerConfig`` fields of a multi-latent-attention model. MLA's q/kv
    down-projection norms are Megatron's ``q_layernorm`` / ``kv_layernorm`` (qk_layernorm);
    MLA owns its rotary embedding (``rotary_*`` fields; GPTModel builds none)."""
    return dict(
        q_lora_rank=model_cfg.q_lora_rank,
        kv_lora_rank=model_cfg.kv_lora_rank,
        qk_head_dim=model_cfg.qk_head_dim,
        qk_pos_emb_head_dim=model_cfg.qk_pos_emb_head_dim,
        v_head_dim=model_cfg.v_head_dim,
        rope_type=model_cfg.rope_type,
        rotary_base=model_cfg.rotary_base,
        rotary_percent=model_cfg.rotary_percent,
        rotary_scaling_factor=model_cfg.rotary_scaling_factor,
        original_max_position_embeddings=model_cfg.original_max_position_embeddings,
        beta_fast=model_cfg.beta_fast,
        beta_slow=model_cfg.beta_slow,
        mscale=model_cfg.mscale,
        mscale_all_dim=model_cfg.mscale_all_dim,
    )


class TorchNorm:
    """Norm builder of the "torch" backend: ``torch.nn.RMSNorm`` / ``torch.nn.LayerNorm``.

    Megatron's ``WrappedTorchNorm`` refuses sequence parallelism because the norm
    weights' gradients would need an all-reduce across TP; scoring never
    back-propagates, so this builder allows it (and marks the weights
    ``sequence_parallel`` like Megatron's TE norms). Same constructor arguments.
    """

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma:
            raise ValueError("zero-centered gamma is not supported by the torch backend")
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _replace_norms(spec, norm: type):
    """Copy of a (nested) spec with every Megatron torch/apex norm replaced by ``norm``."""
    if spec is WrappedTorchNorm or (FusedLayerNorm is not None and spec is FusedLayerNorm):
        return norm
    if isinstance(spec, list | tuple):
        return type(spec)(_replace_norms(s, norm) for s in spec)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {}
        for field in dataclasses.fields(spec):
            value = getattr(spec, field.name)
            new = _replace_norms(value, norm)
            if new is not value:
                changes[field.name] = new
        return dataclasses.replace(spec, **changes) if changes else spec
    return spec


def _with_core_attention(layer_spec: ModuleSpec, core_attention: type) -> ModuleSpec:
    """Copy of a TransformerLayer spec whose self-attention uses ``core_attention``."""
    layer_sub = layer_spec.submodules
    attn = layer_sub.self_attention
    attn = dataclasses.replace(
        attn, submodules=dataclasses.replace(attn.submodules, core_attention=core_attention)
    )
    return dataclasses.replace(
        layer_spec, submodules=dataclasses.replace(layer_sub, self_attention=attn)
    )


def make_layer_specs(
    config: TransformerConfig, backend: str
) -> tuple[TransformerBlockSubmodules, object | None]:
    """Decoder block spec and MTP block spec for ``backend``.

    Args:
        config: the transformer config.
        backend: "te" or "torch".

    Returns:
        ``(decoder block spec, MTP block spec or None)``.
    """
    use_te = backend == "te"
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization=config.normalization
    )
    layers = [mla_layer_spec(s) for s in block.layer_specs]  # both backends (model/mla.py)
    block = dataclasses.replace(block, layer_specs=layers)
    if not use_te:
        layers = [_with_core_attention(s, TorchCoreAttention) for s in layers]
        block = _replace_norms(dataclasses.replace(block, layer_specs=layers), TorchNorm)
    mtp = None
    if config.mtp_num_layers:
        mtp = padding_aware_mtp_spec(
            get_gpt_mtp_block_spec(config, block, use_transformer_engine=use_te)
        )
        if not use_te:
            mtp = _replace_norms(mtp, TorchNorm)
    return block, mtp


def draw_weights(
    model: GPTModel, model_cfg: ModelConfig, seed: int, pg_collection: ProcessGroupCollection
) -> None:
    """Writes a built-in model's random weights from ``seed`` into ``model`` in place
    (:func:`megascore.model.weights.initialize_weights`, one parameter at a time)."""
    initialize_weights(
        model,
        seed=seed,
        init_method_std=model_cfg.init_method_std,
        num_layers=model_cfg.num_layers,
        num_moe_experts=model_cfg.num_moe_experts,
        gated_linear_unit=model_cfg.gated_linear_unit,
        pg_collection=pg_collection,
    )


def build_model(
    model_cfg: ModelConfig,
    engine_cfg: EngineConfig,
    pg_collection: ProcessGroupCollection | None = None,
    *,
    random_weights: bool = True,
    device: torch.device | None = None,
) -> GPTModel:
    """Builds the GPTModel of one replica on this rank.

    Args:
        model_cfg: architecture.
        engine_cfg: parallel sizes, dtype, device, attention backend, seed override.
        pg_collection: process groups from ``initialize_parallel``; None takes
            Megatron's global ones (``ProcessGroupCollection.use_mpu_process_groups``).
        random_weights: draw the weights from the seed (built-in models); False leaves
            the parameters unwritten (uninitialised memory) for a checkpoint loader,
            which must write every one of them.
        device: where to build it (the engine passes the device it resolved at
            start-up); None resolves it from ``engine_cfg``.

    Returns:
        The model on its device, in eval mode, parameters not requiring grad,
        weights drawn from ``engine_cfg.seed`` (or ``model_cfg.seed``) unless
        ``random_weights`` is False. Its attribute ``megascore_attention_backend``
        names the backend in use.

    Raises:
        ValueError: the vocabulary or the heads do not split over the TP ranks, or
            the attention backend is unavailable.
    """
    tp = engine_cfg.tensor_model_parallel_size
    if model_cfg.vocab_size % tp or model_cfg.num_query_groups % tp:
        raise ValueError(
            f"vocab_size ({model_cfg.vocab_size}) and num_query_groups "
            f"({model_cfg.num_query_groups}) must be divisible by TP = {tp}"
        )
    device = device or resolve_device(engine_cfg)
    if device.type == "cpu":
        cpu_compat.apply()
    seed = engine_cfg.seed if engine_cfg.seed is not None else model_cfg.seed
    if device.type == "cpu":
        cpu_compat.seed_rng(seed)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    backend = resolve_attention_backend(engine_cfg, device)
    config = make_transformer_config(model_cfg, engine_cfg, device, backend)
    block_spec, mtp_spec = make_layer_specs(config, backend)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=model_cfg.vocab_size,
        max_sequence_length=model_cfg.max_position_embeddings,
        pre_process=pg_collection.pp.rank() == 0,
        post_process=pg_collection.pp.rank() == pg_collection.pp.size() - 1,
        parallel_output=True,
        share_embeddings_and_output_weights=model_cfg.share_embeddings_and_output_weights,
        position_embedding_type=model_cfg.position_embedding_type,
        rotary_percent=model_cfg.rotary_percent,
        rotary_base=model_cfg.rotary_base,
        rope_scaling=model_cfg.rope_scaling,
        rope_scaling_factor=model_cfg.rope_scaling_factor,
        mtp_block_spec=mtp_spec,
        pg_collection=pg_collection,
    )
    model.to(device)
    if random_weights:
        draw_weights(model, model_cfg, seed, pg_collection)
    model.requires_grad_(False)
    model.eval()
    model.megascore_attention_backend = backend
    logger.info(
        "built %s model: backend=%s dtype=%s device=%s params(local)=%d",
        model_cfg.architecture,
        backend,
        engine_cfg.dtype,
        device,
        sum(p.numel() for p in model.parameters()),
    )
    return model

"""Model architecture config (torch-free) and the built-in named models.

Field names follow Megatron-Core's ``TransformerConfig`` where one exists.
``megascore.model.build`` turns a :class:`ModelConfig` into a ``GPTModel``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ModelConfig:
    """Architecture of a decoder-only GPT-family model (Llama-style by default)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    """Vocabulary size of the checkpoint (token ids must be below it)."""
    ffn_hidden_size: int
    max_position_embeddings: int = 4096
    """Longest sequence served."""
    num_query_groups: int | None = None
    """GQA: number of key/value heads (None = num_attention_heads)."""
    kv_channels: int | None = None
    """Head dim (None = hidden_size // num_attention_heads)."""
    normalization: str = "RMSNorm"
    """"RMSNorm" or "LayerNorm"."""
    layernorm_epsilon: float = 1e-6
    gated_linear_unit: bool = True
    """SwiGLU when True with activation "silu"."""
    activation: str = "silu"
    """"silu" or "gelu"."""
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    """Bias on the QKV projection only (Qwen2)."""
    qk_layernorm: bool = False
    """Per-head RMSNorm on q and k (Qwen3)."""
    position_embedding_type: str = "rope"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rope_scaling: bool = False
    """Llama-3.1-style RoPE frequency scaling."""
    rope_scaling_factor: float = 8.0
    share_embeddings_and_output_weights: bool = False
    # --- multi-latent attention (DeepSeek-V3; Megatron's MLATransformerConfig) ---
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    """Query down-projection rank (None: one full query projection)."""
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    """Per-head query/key dim without RoPE (HF ``qk_nope_head_dim``)."""
    qk_pos_emb_head_dim: int = 64
    """Per-head query/key dim with RoPE (HF ``qk_rope_head_dim``)."""
    v_head_dim: int = 128
    rope_type: str = "rope"
    """MLA RoPE: "rope" or "yarn" (YaRN frequency interpolation)."""
    rotary_scaling_factor: float = 1.0
    """YaRN ``factor``."""
    original_max_position_embeddings: int = 4096
    """YaRN pre-training context length."""
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # --- MoE ---
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_router_score_function: str = "softmax"
    """"softmax" or "sigmoid"."""
    moe_router_pre_softmax: bool = False
    moe_router_load_balancing_type: str | list[str] = "aux_loss"
    """"aux_loss", "seq_aux_loss", "global_aux_loss", "none", or a list of them."""
    moe_aux_loss_coeff: float | list[float] = 0.0
    moe_z_loss_coeff: float | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: int | list[int] = 1
    """1: every layer is MoE; a list of 0/1 per layer (0: dense MLP of ffn_hidden_size)."""
    moe_router_enable_expert_bias: bool = False
    """Routing bias added to the scores for the top-k choice only (DeepSeek-V3's
    ``e_score_correction_bias``)."""
    moe_router_num_groups: int | None = None
    """Group-limited routing: expert groups (HF ``n_group``)."""
    moe_router_group_topk: int | None = None
    """Groups chosen per token (HF ``topk_group``)."""
    moe_router_topk_scaling_factor: float | None = None
    """Factor on the routing probabilities (HF ``routed_scaling_factor``)."""
    moe_router_dtype: str | None = None
    """dtype of the router's gating and scores as the family's trainer runs it: "fp32",
    "fp64", or None (the activations' dtype). Megatron-Bridge trains DeepSeek-V3 and
    GLM-4.5 with "fp32"; ``EngineConfig.moe_router_dtype`` overrides it."""
    # --- MTP ---
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = 0.1
    mtp_not_served: str = ""
    """Why MTP layers the checkpoint's config declares are not served ("" when none are
    left out; :func:`megascore.checkpoint.optional_parts.served_mtp_layers`). A request
    for MTP metrics is refused with it."""
    # --- init ---
    init_method_std: float = 0.02
    seed: int = 1234
    """Seed for random initialisation (built-in models are deterministic)."""
    architecture: str = "gpt"
    """Family label reported by GetModelInfo ("gpt", "llama", "qwen2", ...)."""

    def __post_init__(self):
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})"
            )
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError("hidden_size must be divisible by num_attention_heads")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(
                f"normalization must be RMSNorm or LayerNorm, got {self.normalization}"
            )
        if self.activation not in ("silu", "gelu"):
            raise ValueError(f"activation must be silu or gelu, got {self.activation}")
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise ValueError("moe_router_score_function must be softmax or sigmoid")
        if self.moe_router_dtype not in (None, "fp32", "fp64"):
            raise ValueError(
                f"moe_router_dtype must be fp32, fp64 or None, got {self.moe_router_dtype!r}"
            )
        if self.rope_type not in ("rope", "yarn"):
            raise ValueError(f"rope_type must be rope or yarn, got {self.rope_type}")
        if isinstance(self.moe_layer_freq, list) and len(self.moe_layer_freq) != self.num_layers:
            raise ValueError(
                f"moe_layer_freq lists {len(self.moe_layer_freq)} layers, the model has "
                f"{self.num_layers}"
            )
        if self.vocab_size <= 0 or self.num_layers <= 0:
            raise ValueError("vocab_size and num_layers must be positive")

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)

    @property
    def has_mtp(self) -> bool:
        return bool(self.mtp_num_layers)


# Dense, the embedded default: GQA, SwiGLU, RoPE, untied embeddings.
_TINY = ModelConfig(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    vocab_size=512,
    max_position_embeddings=1024,
)

BUILTIN_MODELS: dict[str, ModelConfig] = {
    "tiny": _TINY,
    # MoE + MTP: 4 experts top-2, shared expert, aux + z losses, 1 MTP layer.
    "tiny-moe": dataclasses.replace(
        _TINY,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
        moe_aux_loss_coeff=[1e-2, 1e-3],
        moe_z_loss_coeff=1e-3,
        moe_shared_expert_intermediate_size=64,
        mtp_num_layers=1,
    ),
    # "tiny" with 5 layers: pipeline layouts up to PP=5, uneven splits (PP=2: 3 + 2).
    "tiny-deep": dataclasses.replace(_TINY, num_layers=5),
    # Dense ~100M parameters for benchmarks.
    "bench": ModelConfig(
        num_layers=12,
        hidden_size=640,
        num_attention_heads=10,
        num_query_groups=5,
        ffn_hidden_size=1728,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    # Llama-3-8B's shape (8.0B parameters, random weights): start-up time, tokens/s and
    # MFU at a real size on a GPU (scripts/gpu_check.sh); 16 GB in bfloat16.
    "bench-8b": ModelConfig(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
    ),
}


def builtin_model(name: str) -> ModelConfig:
    """Returns a fresh copy of a built-in model config by name."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; known: {sorted(BUILTIN_MODELS)}")
    return dataclasses.replace(BUILTIN_MODELS[name])

"""Engine config (torch-free). argparse / YAML / TOML parsing lives at the edge (server)."""

from __future__ import annotations

import dataclasses

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "te")
DEVICES = ("auto", "cpu", "cuda")


@dataclasses.dataclass
class EngineConfig:
    """How one model replica is built and run. Identical on every rank."""

    model: str = "tiny"
    """Built-in model name (tiny, tiny-moe, bench), ``hf:DIR`` or ``megatron:DIR``."""
    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    sequence_parallel: bool = False
    """Megatron sequence parallelism (only meaningful with TP > 1)."""
    device: str = "auto"
    """"cpu", "cuda" or "auto" (cuda when available)."""
    dtype: str = "float32"
    attention_backend: str = "auto"
    """"te" (TransformerEngine, GPU), "torch" (portable SDPA) or "auto"."""
    pad_to_multiple_of: int = 1
    """Extra per-sequence pad multiple (combined with what CP / SP require)."""
    max_top_k: int = 64
    logprob_chunk_tokens: int = 1024
    """Tokens per chunk of the vocab-parallel log-softmax (bounds peak memory)."""
    collective_timeout_s: float = 120.0
    """Timeout of every collective; a hung rank fails the step instead of hanging."""
    seed: int | None = None
    """Overrides the model config's seed for built-in random weights."""

    def __post_init__(self):
        for name in (
            "tensor_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "pad_to_multiple_of",
            "max_top_k",
            "logprob_chunk_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.collective_timeout_s <= 0:
            raise ValueError("collective_timeout_s must be > 0")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("sequence_parallel needs tensor_model_parallel_size > 1")

    @property
    def model_parallel_size(self) -> int:
        """Ranks per replica: TP x CP (EP shares ranks with the data/CP dimension)."""
        return self.tensor_model_parallel_size * self.context_parallel_size

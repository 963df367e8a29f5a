"""The scoring engine: packed forward, logprobs, losses, metrics, distributed runtime."""

from megascore.deferred_compile import install as _defer_megatron_compile

_defer_megatron_compile()  # before any module here imports Megatron-Core

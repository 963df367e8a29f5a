"""Megatron-Core model building: configs, attention backends, CPU compatibility."""

from megascore.deferred_compile import install as _defer_megatron_compile

_defer_megatron_compile()  # before any module here imports Megatron-Core

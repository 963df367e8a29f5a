"""Megatron-Core model building: configs, attention backends, CPU compatibility."""

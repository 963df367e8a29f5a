"""The scoring engine: packed forward, logprobs, losses, metrics, distributed runtime."""

"""megascore: score token sequences with Megatron-Core models over gRPC.

``api`` (the contract every side shares), its ``v1`` stubs and ``config`` are
torch-free; ``engine``, ``model`` and ``checkpoint`` import torch where they need it.
"""

__version__ = "0.1.0"

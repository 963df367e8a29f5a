"""megascore: score token sequences with Megatron-Core models over gRPC.

This package and its ``v1`` stubs are torch-free; torch-dependent modules
(``packing``, ``distributed``, ``model``, ``engine``) import torch themselves.
"""

__version__ = "0.1.0"

"""megascore client SDK: score token sequences on a megascore server over gRPC.

Torch-free (inputs are duck-typed array-likes, outputs numpy) and free of the
server package. Sync and asyncio clients share one API::

    from megascore_client import ScoringClient

    with ScoringClient("127.0.0.1:50051", token="...") as client:
        result = client.score([[1, 2, 3], [4, 5, 6, 7]], top_k=5)
        result.logprobs[1]  # float32 [4]; entry 0 is 0.0, entry t = log p(x_t | x_<t)

Every failure raises :class:`ScoringError` (``code`` is the ``grpc.StatusCode``).
"""

from megascore import __version__
from megascore_client.aio import AsyncScoringClient
from megascore_client.channel import DEFAULT_MAX_MESSAGE_BYTES, RetryPolicy, TlsConfig
from megascore_client.client import ScoringClient
from megascore_client.errors import InvalidInputError, ScoringError
from megascore_client.push.requests import PushResult, RawTensor, read_safetensors
from megascore_client.results import (
    HealthStatus,
    LoadWeightsResult,
    ModelInfo,
    ParallelLayout,
    ScoreResult,
    Timings,
)
from megascore_client.splitting import ScoreOptions
from megascore_client.stream import AsyncScoreStream, ScoreStream
from megascore_client.text import Detokenized, TextScoreResult

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "AsyncScoreStream",
    "AsyncScoringClient",
    "Detokenized",
    "HealthStatus",
    "InvalidInputError",
    "LoadWeightsResult",
    "ModelInfo",
    "ParallelLayout",
    "PushResult",
    "RawTensor",
    "RetryPolicy",
    "ScoreOptions",
    "ScoreResult",
    "ScoreStream",
    "ScoringClient",
    "ScoringError",
    "TextScoreResult",
    "Timings",
    "TlsConfig",
    "read_safetensors",
    "__version__",
]

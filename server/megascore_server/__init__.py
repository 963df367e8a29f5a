"""megascore_server: the gRPC front end of a megascore replica (torch-free).

``build_server`` assembles the ``megascore.v1.Scorer`` server around any
:class:`megascore.api.types.Engine`; ``megascore_server.main.main`` is ``megascore serve``.
"""

from megascore_server.app import ServerHandles, build_server
from megascore_server.config import GrpcServerConfig, ReplicaConfig

__all__ = ["ReplicaConfig", "GrpcServerConfig", "ServerHandles", "build_server"]

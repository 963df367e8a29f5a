"""``grpc.health.v1`` for the overall server ("") and ``megascore.v1.Scorer``.

Lifecycle: NOT_SERVING from creation until the engine is ready
(:meth:`ScorerHealth.set_serving`), SERVING after, NOT_SERVING for good on
drain or when a rank is lost (:meth:`ScorerHealth.shut_down`).
"""

from __future__ import annotations

import logging

from grpc_health.v1 import health, health_pb2

from megascore.v1 import scoring_pb2 as pb

logger = logging.getLogger(__name__)

SCORER_SERVICE = pb.DESCRIPTOR.services_by_name["Scorer"].full_name
SERVICES = ("", SCORER_SERVICE)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ScorerHealth(health.aio.HealthServicer):
    """Health servicer starting NOT_SERVING for "" and the Scorer service."""

    def __init__(self):
        super().__init__()
        for service in SERVICES:
            self._server_status[service] = NOT_SERVING
        self.serving = False

    async def set_serving(self) -> None:
        """Marks the server ready (the engine answered on every rank)."""
        for service in SERVICES:
            await self.set(service, SERVING)
        self.serving = not self._gracefully_shutting_down
        logger.info("health: SERVING" if self.serving else "health: stays NOT_SERVING")

    async def shut_down(self, reason: str) -> None:
        """NOT_SERVING for good (drain or lost rank); later :meth:`set_serving` is ignored."""
        self.serving = False
        await self.enter_graceful_shutdown()
        logger.warning("health: NOT_SERVING (%s)", reason)

"""``grpc.health.v1`` for the overall server ("") and ``megascore.v1.Scorer``.

Lifecycle: NOT_SERVING from creation until the engine is ready
(:meth:`ScorerHealth.set_serving`), SERVING after, NOT_SERVING for good on
drain or when a rank is lost (:meth:`ScorerHealth.shut_down`). Health only
publishes: whether the server serves is decided by
:class:`megascore_server.gate.CallGate`, which the Scorer asks too. A Watch
stream sends NOT_SERVING and ends at that point: an open watcher (gRPC
client-side health checking, a load balancer) would otherwise hold
``server.stop(grace)`` for the whole grace period of every drain.
"""

from __future__ import annotations

import asyncio
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
        self._changed = asyncio.Condition()
        self._version = 0  # bumped on every status change, under ``_changed``

    async def _notify(self) -> None:
        async with self._changed:
            self._version += 1
            self._changed.notify_all()

    async def set(self, service: str, status) -> None:
        await super().set(service, status)
        await self._notify()

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        await self._notify()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context) -> None:
        """Streams every status change of ``request.service``, like grpc's Watch, but
        ends the stream after the final NOT_SERVING of a drain or lost rank."""
        seen, last = -1, None
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda seen=seen: self._version != seen)
                seen = self._version
                status = self._server_status.get(
                    request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                )
                final = self._gracefully_shutting_down
            if status != last:  # written outside the lock: a slow watcher blocks no one
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if final:
                return

    @property
    def serving(self) -> bool:
        """Whether SERVING is published (for the server as a whole)."""
        return self._server_status[""] == SERVING

    async def set_serving(self) -> None:
        """Publishes SERVING (the gate opened: the engine answered on every rank)."""
        for service in SERVICES:
            await self.set(service, SERVING)
        logger.info("health: SERVING" if self.serving else "health: stays NOT_SERVING")

    async def shut_down(self, reason: str) -> None:
        """NOT_SERVING for good (drain or lost rank); later :meth:`set_serving` is ignored."""
        await self.enter_graceful_shutdown()
        logger.warning("health: NOT_SERVING (%s)", reason)

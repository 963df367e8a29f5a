"""The open-files limit and the connection cap both fronts derive from it.

Every client connection holds a file descriptor of rank 0, beside the checkpoint files,
the sockets between ranks and the engine's own. Many hosts start processes at a soft
``RLIMIT_NOFILE`` of 1,024 under a hard limit far above it, so ``megascore serve``
raises the soft limit to the hard one at start-up (:func:`raise_open_files_limit`,
inherited by the ranks it launches); and each front keeps at most
:func:`connection_cap` connections open, so that a flood of connections on one front
leaves descriptors for the other front and for the files (docs/deploy.md "Slow and
flooding clients").
"""

from __future__ import annotations

import logging
import resource

logger = logging.getLogger(__name__)

CAP_SHARE = 3
"""A front's default cap is the open-files limit divided by this: the two fronts
together leave a third of the descriptors to everything else."""
UNLIMITED_CAP = 1 << 20
"""The cap when the open-files limit is unlimited."""


def raise_open_files_limit() -> int:
    """Raises this process's soft ``RLIMIT_NOFILE`` to its hard limit; returns the soft
    limit now in force (the old one, logged, when the system refuses)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # e.g. an unlimited hard limit above fs.nr_open
        logger.warning(
            "open files: soft limit %d kept, raising it to %d failed: %s", soft, hard, exc
        )
        return soft
    logger.info("open files: soft limit raised from %d to the hard limit %d", soft, hard)
    return hard


def connection_cap(max_connections: int) -> int:
    """The most connections one front keeps open.

    Args:
        max_connections: the configured cap (``GrpcServerConfig.max_connections``);
            0 = a :data:`CAP_SHARE`-th of the soft open-files limit in force now.
    """
    if max_connections:
        return max_connections
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return UNLIMITED_CAP
    return max(1, soft // CAP_SHARE)

"""Free TCP ports below the kernel's ephemeral range, for servers started by a parent.

A parent that picks a port for a child (``scripts/demo.sh``, the test helpers) cannot
hold it while the child starts. A port from ``bind(0)``, released again, is exactly
what any other process's ``bind(0)`` or outgoing connection may take in between; a
port below the ephemeral range is taken only by a process that asks for that port.
"""

from __future__ import annotations

import random
import socket

_PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LINUX_EPHEMERAL_LOW = 32768  # the kernel's default when the file cannot be read


def ephemeral_port_low() -> int:
    """First port of the kernel's ephemeral range (``bind(0)`` and outgoing connections)."""
    try:
        with open(_PORT_RANGE_FILE, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _LINUX_EPHEMERAL_LOW


def pick_port(host: str = "127.0.0.1", low: int = 20000, tries: int = 200) -> int:
    """A port free now on ``host``, below the ephemeral range (see the module docstring).

    Args:
        host: address the port must be free on.
        low: lowest port tried (the ports below stay for services' fixed ports).
        tries: random candidates tried in ``[low, ephemeral_port_low())``.

    Returns:
        The port (nothing holds it when this returns).

    Raises:
        RuntimeError: no free candidate, or no room below the ephemeral range.
    """
    high = ephemeral_port_low()
    if high <= low:
        raise RuntimeError(
            f"no port between {low} and the ephemeral range, which starts at {high} "
            f"({_PORT_RANGE_FILE})"
        )
    rng = random.Random()  # not the global one: callers may seed it
    for port in rng.sample(range(low, high), min(tries, high - low)):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port among {tries} tried in [{low}, {high})")

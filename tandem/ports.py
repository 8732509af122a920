"""Free local TCP ports for listeners that bind later: the service's own
(gRPC, metrics, HTTP, the transfer group's rendezvous) and the tests' and
benches' services.

A port the kernel hands out for `bind(0)` comes from its ephemeral range,
the same range every outgoing connection's local port is drawn from; if the
listener binds seconds later, a connection in between may hold that port.
It did in CI (12-07): the disaggregated service's router, which binds only
once the workers' gloo group has formed (a full mesh of TCP connections),
found its port taken. So these ports come from below the ephemeral range.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10000           # above the well-known and most registered services' ports
LINUX_EPHEMERAL = 32768  # the kernel's default first ephemeral port
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_floor() -> int:
    """The first port of the kernel's ephemeral range (Linux's default
    where the range cannot be read)."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return LINUX_EPHEMERAL


def free_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A port that is free on `host` now and lies below the ephemeral range,
    so that no outgoing connection takes it before its listener binds
    (where the range starts too low to leave room, the kernel's choice)."""
    high = ephemeral_floor()
    if high - LOWEST < 2 * tries:
        return _bound_port(host, 0)
    draw = random.Random()   # its own generator: no shared state to seed or disturb
    for _ in range(tries):
        try:
            return _bound_port(host, draw.randrange(LOWEST, high))
        except OSError:   # in use
            continue
    raise OSError(f"no free port on {host} in {LOWEST}..{high - 1} after {tries} tries")


def _bound_port(host: str, port: int) -> int:
    with socket.socket() as s:
        s.bind((host, port))
        return s.getsockname()[1]

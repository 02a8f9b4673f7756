"""Ports on 127.0.0.1 for local nodes: a free one, a block of consecutive free ones, whether one is in use."""

from __future__ import annotations

import os
import random
import socket
import threading

from mqds.tools.errors import LocalClusterError

_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST = 20000


def _below_ephemeral() -> int:
    """Where the kernel's range for outgoing connections' ports begins (32768 by default)."""
    try:
        with open(_EPHEMERAL_RANGE) as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


SHARE_ENV = "MQDS_PORT_SHARE"
"""``i/n``: this process picks ports only from the i-th of n equal slices of the range (0-based).

Processes that start local nodes side by side (the test suite's parallel
workers set it, one slice each) then never pick the same port: the set of
ports handed out is one process's, and two workers once gave two nodes the
same port, the second of which could not listen.
"""


def _port_range() -> tuple[int, int]:
    """Where this process picks ports: [low, high), below the ephemeral range, its slice of it under SHARE_ENV."""
    low, high = _LOWEST, _below_ephemeral()
    share = os.environ.get(SHARE_ENV)
    if share:
        try:
            index, count = (int(part) for part in share.split("/"))
        except ValueError:
            raise LocalClusterError(f"{SHARE_ENV} must be 'i/n' (the i-th of n slices from 0), not {share!r}") from None
        if not 0 <= index < count:
            raise LocalClusterError(f"{SHARE_ENV}={share!r}: i must be from 0 to n - 1")
        width = (high - low) // count
        low += index * width
        high = low + width
    return low, high


def free_port() -> int:
    """A port free on 127.0.0.1 now, below the ephemeral range, and never one this process handed out before.

    A port the kernel picks (a bind to port 0) comes from the range it also
    gives outgoing connections: with other tests connecting meanwhile, one
    took a node's port between the pick and the node's bind ("address
    already in use", a whole test module's cluster lost). Below that range
    only a listener can take it. The kernel may also give the same port to
    two binds in a row: two nodes of one cluster were once given the same
    port, hence the set of ports handed out.
    """
    low, high = _port_range()
    rng = random.Random()
    with _handed_out_lock:
        for _ in range(200):
            if high - low > 1000:
                port = rng.randrange(low, high)
                if port in _handed_out or port_in_use(port):
                    continue
            else:  # an unusual ephemeral range: let the kernel pick
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = int(sock.getsockname()[1])
                if port in _handed_out:
                    continue
            _handed_out.add(port)
            return port
    raise LocalClusterError("found no free port on 127.0.0.1 that was not handed out already")


def port_in_use(port: int) -> bool:
    """Whether something listens on 127.0.0.1:``port`` (connections lingering in TIME_WAIT do not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def free_port_block(count: int, attempts: int = 200) -> int:
    """A port P with P .. P+count-1 all free now, for a cluster on consecutive ports."""
    rng = random.Random()
    for _ in range(attempts):
        # Below the usual ephemeral range (32768+), where outgoing connections take ports.
        low, high = _port_range()
        base = rng.randrange(low, max(low + 1, high - count))
        if not any(port_in_use(base + i) for i in range(count)):
            return base
    raise LocalClusterError(f"found no {count} consecutive free ports on 127.0.0.1")

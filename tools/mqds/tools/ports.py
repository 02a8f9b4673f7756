"""Ports on 127.0.0.1 for local nodes: a free one, a block of consecutive free ones, whether one is in use."""

from __future__ import annotations

import random
import socket
import threading

from mqds.tools.errors import LocalClusterError

_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """A port free on 127.0.0.1 now, and never one this process handed out before.

    The kernel may give the same port to two binds in a row once the first
    socket is closed: two nodes of one cluster were once given the same
    port, and the second could not listen.
    """
    with _handed_out_lock:
        for _ in range(100):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
            if port not in _handed_out:
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
        base = rng.randrange(20000, 32000 - count)
        if not any(port_in_use(base + i) for i in range(count)):
            return base
    raise LocalClusterError(f"found no {count} consecutive free ports on 127.0.0.1")

"""Which listen addresses only this machine can reach: the line between a private and an exposed port.

A node without client tokens and an ExHook provider without client
certificates authenticate no caller; they may serve only where no other
machine can call them. Both decide that with :func:`is_loopback`.
"""

from __future__ import annotations

import ipaddress


def listen_host(address: str) -> str:
    """The host of ``HOST:PORT`` (``[::1]:7101`` -> ``::1``)."""
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(address: str) -> bool:
    """Whether a server bound to ``address`` (``HOST:PORT``) takes connections from this machine only.

    Loopback addresses (127.0.0.0/8, ::1) and the name ``localhost`` are;
    the wildcard addresses (0.0.0.0, ::), interface addresses and every
    other name are not: a name may resolve to anything, so it counts as
    exposed.
    """
    host = listen_host(address)
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

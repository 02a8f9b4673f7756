"""Ports for local nodes: never one an outgoing connection can take between the pick and the node's bind."""

from __future__ import annotations

import socket

import pytest

from mqds.tools import ports
from mqds.tools.errors import LocalClusterError


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == len(picked)
    # Outgoing connections take their local ports from the ephemeral range; a test module's
    # cluster once lost a node to one that took its port first.
    assert all(port < ports._below_ephemeral() for port in picked)
    for port in picked[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_block_of_ports_is_free_and_below_the_ephemeral_range() -> None:
    base = ports.free_port_block(5)
    assert base + 5 <= ports._below_ephemeral()
    assert not any(ports.port_in_use(base + i) for i in range(5))


def test_a_share_of_the_range_keeps_side_by_side_processes_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parallel test workers each pick from a slice of their own: two of them once gave two nodes one port."""
    monkeypatch.setenv(ports.SHARE_ENV, "1/3")
    low, high = ports._port_range()
    width = (ports._below_ephemeral() - ports._LOWEST) // 3
    assert (low, high) == (ports._LOWEST + width, ports._LOWEST + 2 * width)
    assert all(low <= ports.free_port() < high for _ in range(30))
    base = ports.free_port_block(4)
    assert low <= base and base + 4 <= high
    for bad in ("3/3", "x", "1/0"):
        monkeypatch.setenv(ports.SHARE_ENV, bad)
        with pytest.raises(LocalClusterError, match=ports.SHARE_ENV):
            ports.free_port()

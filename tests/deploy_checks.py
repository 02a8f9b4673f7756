"""Probes of what a deployment runs, shared by the image test and the compose and Kubernetes tests:
a port that accepts, a node's metrics, an MQTT broker that stores what it is sent."""

from __future__ import annotations

import re
import socket
import urllib.request

import paho.mqtt.client as mqtt

from mqds.client import Client, ConnectionSettings
from mqds.tools.waiting import wait_until

READY = "mqds.v1.Storage"
"""The health service a node reports SERVING on once it serves reads and writes."""


def scrape(address: str) -> str:
    """GET /metrics (MQDS_METRICS_LISTEN): Prometheus text with mqds_ metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = str(reply.read().decode())
    assert re.search(r"^mqds_\w+", text, re.M), text[:2000]
    return text


def container_port(address: str) -> int:
    return int(address.rpartition(":")[2])


def accepts(address: str) -> bool:
    """A tcpSocket probe: the port accepts a connection."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return False
    return True


def check_broker_serves(address: str, endpoints: list[str], topic: str, token: str | None = None) -> None:
    """An MQTT client connects (CONNACK: accepted) and publishes at QoS 1; the message lands in the cluster
    (read back with ``token``, a reader's or better, where the nodes check tokens)."""
    host, _, port = address.rpartition(":")
    connected: list[object] = []
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"deploy-{topic}")
    client.on_connect = lambda _c, _u, _f, reason, _p: connected.append(reason)
    client.connect(host, int(port), keepalive=30)
    client.loop_start()
    try:
        wait_until("CONNACK", lambda: connected or None, 15)
        assert not connected[0].is_failure, f"CONNACK {connected[0]}"
        sent = client.publish(f"{topic}/a", b"via the broker", qos=1)
        sent.wait_for_publish(15)
        assert sent.is_published()
    finally:
        client.disconnect()
        client.loop_stop()
    with Client(endpoints, settings=ConnectionSettings(timeout_s=30, auth_token=token)) as mqds:
        stored = wait_until(f"{topic}/a stored", lambda: list(mqds.replay(f"{topic}/#")) or None, 30)
    assert [(m.topic, m.payload) for m in stored] == [(f"{topic}/a", b"via the broker")]

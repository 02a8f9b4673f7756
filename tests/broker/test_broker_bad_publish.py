"""Through `mqds broker`, one client's bad publish fails alone: other clients' publishes are stored and acknowledged.

The plugin stores the publishes of a shard in waves, one store call per
wave, whoever sent them. A publish the node cannot store (here a payload
over the cluster's max_payload_bytes) used to fail its whole wave: every
other client's publish in it was not acknowledged and its connection was
closed. Now only the bad publish fails (its client is disconnected without a
PUBACK, as for any failed store, and the broker logs why).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import paho.mqtt.client as mqtt
import pytest
from mqtt_support import BrokerProcess

from mqds.client import Client
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N_SHARDS = 2
MAX_PAYLOAD = 64 * 1024
N_GOOD = 1000
HOOKS = """
[[rule]]
hook = "message.publish"
topic = "#"
action = "on_message_publish"
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    args = [f"--max-payload-bytes={MAX_PAYLOAD}"]
    with LocalCluster(tmp_path_factory.mktemp("broker-bad") / "c", 3, n_shards=N_SHARDS, args=args) as c:
        c.start()
        c.wait_leaders_settled()
        yield c


@pytest.fixture(scope="module")
def broker(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    workdir = tmp_path_factory.mktemp("broker")
    hooks = workdir / "hooks.toml"
    hooks.write_text(HOOKS)
    process = BrokerProcess(workdir, ",".join(cluster.addresses), hooks, "broker-bad")
    try:
        process.start()
        yield process
    finally:
        process.kill()


class Publisher:
    """A paho client that counts its disconnections and does not reconnect (a drop stays visible)."""

    def __init__(self, port: int, clientid: str) -> None:
        self.disconnects = 0
        self.acked = 0
        self.connected = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=clientid, clean_session=True)
        self.client.max_inflight_messages_set(500)
        self.client.reconnect_delay_set(3600, 3600)
        self.client.on_connect = lambda *_: self.connected.set()
        self.client.on_disconnect = self._on_disconnect
        self.client.on_publish = self._on_publish
        self.client.connect("127.0.0.1", port, keepalive=30)
        self.client.loop_start()
        assert self.connected.wait(10), f"{clientid} did not connect"

    def _on_disconnect(self, *_: object) -> None:
        self.disconnects += 1

    def _on_publish(self, *_: object) -> None:
        self.acked += 1

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def same_shard_ids(prefix: str, count: int) -> list[str]:
    ids = (f"{prefix}-{i}" for i in range(10_000))
    return [i for i in ids if shard_of(i, N_SHARDS) == 0][:count]


def test_a_clients_bad_publish_does_not_fail_another_clients_publishes(
    cluster: LocalCluster, broker: BrokerProcess
) -> None:
    tag = uuid.uuid4().hex[:8]
    good_id, *bad_ids = same_shard_ids(f"bad-pub-{tag}", 6)  # one shard: their publishes share waves
    good = Publisher(broker.port, good_id)
    bad = [Publisher(broker.port, clientid) for clientid in bad_ids]
    try:
        sent = [good.client.publish(f"bad/good/{tag}", str(i).encode(), qos=1) for i in range(N_GOOD)]
        deadline = time.monotonic() + 60
        for k, publisher in enumerate(bad, 1):
            # Each bad publish (over max_payload_bytes) while hundreds of the good client's wait to be stored:
            # it lands in a wave with some of them.
            wait_until(
                "the good client's stores under way", lambda k=k: good.acked >= k * N_GOOD // 8 or good.disconnects, 60
            )
            publisher.client.publish(f"bad/big/{tag}", b"x" * (MAX_PAYLOAD + 1), qos=1)
        for info in sent:
            info.wait_for_publish(max(0.0, deadline - time.monotonic()))
        assert good.disconnects == 0, "the good client was disconnected for another client's publish"
        assert all(info.is_published() for info in sent), "the good client's publishes were not all acknowledged"
        wait_until("the bad clients disconnected", lambda: all(b.disconnects for b in bad), 30)
    finally:
        for publisher in (good, *bad):
            publisher.close()
    with Client(cluster.addresses, timeout_s=30) as reader:
        assert sorted(int(m.payload) for m in reader.replay(f"bad/good/{tag}")) == list(range(N_GOOD))
        assert list(reader.replay(f"bad/big/{tag}")) == []
    wait_until("the broker logged why it refused them", lambda: "PAYLOAD_TOO_LARGE" in broker.output(), 10)

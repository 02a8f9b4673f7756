"""Queue redelivery through `mqds broker` (issue 47), end to end with paho-mqtt: a queue message its reader never
acknowledges is delivered again at its next connection, counted, and after its last delivery it goes to the
dead-letter topic instead of coming back forever; an acknowledged one never comes back."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from mqtt_support import BrokerProcess, Mqtt, payloads

from mqds.tools.local_cluster import LocalCluster
from mqds.tools.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RULES = [
    ("client.connected", "", "on_client_connected"),
    ("client.connected", "", "on_subscribe_lookup"),
    ("client.disconnected", "", "on_client_disconnected"),
    ("message.publish", "#", "on_message_publish"),
    ("session.subscribed", "#", "on_subscription_store"),
    ("session.subscribed", "rdq/#", "on_message_fetch_for_queue"),
    ("message.acked", "#", "on_message_acked"),
]
"""(hook, topic, action): everything stored, subscriptions restored at connect, queue delivery on ``rdq/#``."""
HOOKS = "\n".join(
    f'[[rule]]\nhook = "{hook}"\n' + (f'topic = "{topic}"\n' if topic else "") + f'action = "{action}"\n'
    for hook, topic, action in RULES
)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("broker-redelivery") / "nodes", 3, n_shards=2) as cluster:
        cluster.start()
        yield cluster


@pytest.fixture(scope="module")
def broker(nodes: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    workdir: Path = tmp_path_factory.mktemp("broker")
    hooks = workdir / "hooks.toml"
    hooks.write_text(HOOKS)
    process = BrokerProcess(workdir, ",".join(nodes.addresses), hooks, "broker-redelivery")
    # A minute's ack wait: what comes back at the next connection was given back by the broker, not waited out.
    process.args += ["--queue-ack-wait-ms", "60000", "--queue-max-deliveries", "2"]
    process.args += ["--queue-dead-letter-topic", "rdq-dead/jobs"]
    try:
        process.start()
        yield process
    finally:
        process.kill()


def test_a_poison_message_is_redelivered_then_dead_lettered(nodes: LocalCluster, broker: BrokerProcess) -> None:
    reader = Mqtt(broker.port, "rdq-reader", clean_session=False, manual_ack=True)
    assert reader.subscribe("rdq/#") == 1
    reader.close()
    publisher = Mqtt(broker.port, "rdq-pub", clean_session=True)
    try:
        publisher.publish("rdq/jobs", "poison")
        for _ in range(2):  # its two deliveries, each one never acknowledged
            reader = Mqtt(broker.port, "rdq-reader", clean_session=False, manual_ack=True)
            assert payloads(reader.take(1, timeout_s=15)) == ["poison"]
            assert reader.quiet(0.5) == []
            reader.close()
        reader = Mqtt(broker.port, "rdq-reader", clean_session=False)
        assert reader.quiet(2.0) == []  # past its last delivery: not delivered again
        with nodes.client(timeout_s=30) as client:
            (letter,) = client.fetch_offline("auditor", "rdq-dead/#", max_count=10)
        props = dict(letter.properties)
        assert letter.payload == b"poison" and props["mqds-dead-letter-topic"] == "rdq/jobs"
        assert props["mqds-deliveries"] == "2" and props["mqds-dead-letter-consumer"] == "rdq-reader rdq/#"
        # A message the reader acknowledges is delivered once.
        reader.close()
        publisher.publish("rdq/jobs", "fine")
        reader = Mqtt(broker.port, "rdq-reader", clean_session=False)
        assert payloads(reader.take(1, timeout_s=15)) == ["fine"]
        reader.close()
        reader = Mqtt(broker.port, "rdq-reader", clean_session=False)
        assert reader.quiet(1.5) == []
        reader.close()
    finally:
        publisher.close()
    broker.stop()
    wait_until("the stop summary", lambda: "stopped after" in broker.output(), 10)
    assert re.search(r"queue redelivery: 1 redelivered, \d+ given back, 1 dead-lettered", broker.output())

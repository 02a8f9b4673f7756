"""Message expiry through `mqds broker` (issue 47): a persistent subscriber gets none of the messages whose MQTT 5
Message Expiry Interval ran out while it was away, and all the others.

The bundled broker (amqtt) speaks MQTT 3.1.1, which has no expiry interval:
its clients can neither publish one nor be told what is left of one. Messages
with an interval reach the cluster from MQTT 5 brokers (EMQX through
``mqds exhook``) or from programs with the client library; here the client
library stores them, as such a broker would, while the subscriber is offline.
What the subscriber gets when it comes back is what the broker's offline fetch
(``FetchMessagesShared``, through ``OfflineFetches``) returned: the test shows
the expired messages are not among them, with paho-mqtt end to end on a real
3-node cluster.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from harness import cluster_up
from mqtt_support import BrokerProcess, Mqtt, payloads

from mqds.broker.actions import BrokerHooks
from mqds.broker.amqtt_plugin import DEFAULT_RULES
from mqds.broker.exhook.provider import HookProvider
from mqds.broker.exhook.v3 import exhook_pb2 as xpb
from mqds.client import Client, Message, aio
from mqds.tools.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N_SHARDS = 4


@pytest.fixture(scope="module")
def endpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with cluster_up(tmp_path_factory.mktemp("broker-expiry") / "cluster", N_SHARDS) as found:
        yield found


@pytest.fixture(scope="module")
def broker(endpoints: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    # The built-in rules: QoS 1 and 2 stored, subscriptions stored and looked up at connect, pubsub offline
    # delivery on every topic, acknowledgements on PUBACK.
    process = BrokerProcess(tmp_path_factory.mktemp("broker"), endpoints, None, "broker-expiry")
    try:
        process.start()
        yield process
    finally:
        process.kill()


def test_a_persistent_subscriber_back_after_expiry_gets_none_of_the_expired_messages_and_all_the_others(
    endpoints: str, broker: BrokerProcess
) -> None:
    subscriber = Mqtt(broker.port, "mx-sub", clean_session=False)
    try:
        assert subscriber.subscribe("mx/e2e/#", qos=1) == 1
    finally:
        subscriber.close()
    with Client(endpoints, timeout_s=30) as c:
        wait_until(
            "mx-sub offline with its read position started",
            lambda: (
                (state := c.client_state("mx-sub")) is not None
                and not state.online
                and c.read_position("mx-sub", "mx/e2e/#").found
            ),
            10,
        )
        # Published while it is away, from several devices: every third with a 1 s interval, every third with a
        # long one (its remaining interval is the broker's to forward; amqtt's MQTT 3.1.1 cannot), the rest none.
        stored = c.store_batch(
            [
                Message(
                    topic=f"mx/e2e/dev{i % 4}",
                    payload=f"m{i}".encode(),
                    sender=f"mx-dev{i % 4}",
                    qos=1,
                    message_expiry_s=(1, 3600, 0)[i % 3],
                )
                for i in range(30)
            ]
        )
        kept = [m.payload.decode() for m in stored if m.message_expiry_s != 1]
        # Past the short interval: a bounded wait of about a second.
        newest = max(m.timestamp_us or 0 for m in stored) / 1e6
        time.sleep(max(0.0, newest + 1 - time.time()) + 0.3)
        back = Mqtt(broker.port, "mx-sub", clean_session=False)  # resumes its session: its filter is kept
        try:
            assert back.session_present is True
            got = payloads(back.take(len(kept)))
            assert sorted(got) == sorted(kept)
            # Per device in the order stored, and nothing more: none of the expired ones comes after them.
            for device in range(4):
                mine = [p for p in got if int(p[1:]) % 4 == device]
                assert mine == [p for p in kept if int(p[1:]) % 4 == device]
            assert back.quiet(1.0) == []
        finally:
            back.close()


def test_exhook_stores_the_publish_s_expiry_interval_and_the_fetch_leaves_the_message_out_once_it_ended(
    endpoints: str,
) -> None:
    """EMQX's OnMessagePublish with an MQTT 5 ``Message-Expiry-Interval``: the provider stores it with the message
    (through the client's pipelined ``publish``), so an offline fetch leaves the message out once it ended and
    gives the others what is left of theirs."""

    def publish(i: int, expiry: str | None) -> xpb.MessagePublishRequest:
        props = [xpb.Property(name="Message-Expiry-Interval", value=expiry)] if expiry is not None else []
        message = xpb.Message(id=f"x{i}", qos=1, topic="mx/exhook/dev", payload=f"x{i}".encode(), **{"from": "x-pub"})
        return xpb.MessagePublishRequest(message=message, props=props)

    async def scenario() -> None:
        async with aio.Client(endpoints, timeout_s=30) as client:
            provider = HookProvider(BrokerHooks(client, DEFAULT_RULES, node="emqx-1"))
            for i, expiry in enumerate(["1", "3600", None]):
                answer = await provider.OnMessagePublish(publish(i, expiry), None)
                assert answer.type == xpb.ValuedResponse.CONTINUE

    asyncio.run(scenario())
    with Client(endpoints, timeout_s=30) as c:
        stored = list(c.replay("mx/exhook/#"))  # x0 may be gone already: removed once expired
        assert {m.payload: m.message_expiry_s for m in stored if m.payload != b"x0"} == {b"x1": 3600, b"x2": 0}
        newest = max(m.timestamp_us or 0 for m in stored) / 1e6
        time.sleep(max(0.0, newest + 1 - time.time()) + 0.3)
        got = c.fetch_offline("mx-exhook-sub", "mx/exhook/#")
        assert [m.payload for m in got] == [b"x1", b"x2"]
        assert 3600 - 5 <= got[0].message_expiry_s < 3600 and got[1].message_expiry_s == 0

"""amqtt speaks MQTT 3.1.1 only: an MQTT 5 client is refused at once, as MQTT 3.1.1 prescribes.

An MQTT 5 CONNECT resuming a session (clean start off, a Session Expiry
Interval property) made amqtt wait for bytes that never came: the client got no
CONNACK and hung. Importing the mqds plugin (as ``mqds broker`` does) makes
amqtt answer CONNACK 0x01 (unacceptable protocol version) and close.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import paho.mqtt.client as mqtt
import pytest
from amqtt.broker import Broker
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

import mqds.broker.amqtt_plugin  # noqa: F401 - what mqds broker imports: it installs the protocol check
from mqds.tools.ports import free_port

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def broker_port() -> Iterator[int]:
    port = free_port()
    config = {
        "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}"}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }
    loop = asyncio.new_event_loop()
    brokers: list[Broker] = []
    started = threading.Event()

    def run() -> None:
        # amqtt's Broker wants the running thread's event loop when it is made: made here.
        asyncio.set_event_loop(loop)
        brokers.append(Broker(config, loop=loop))
        loop.run_until_complete(brokers[0].start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10)
    yield port
    asyncio.run_coroutine_threadsafe(brokers[0].shutdown(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _first_connack(port: int, protocol: int, **connect: object) -> str | None:
    answers: list[str] = []
    done = threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"c{protocol}", protocol=protocol)

    def on_connect(*args: object) -> None:
        answers.append(str(args[3]))
        done.set()

    client.on_connect = on_connect
    client.reconnect_delay_set(30, 30)
    client.connect("127.0.0.1", port, **connect)  # type: ignore[arg-type]
    client.loop_start()
    try:
        done.wait(5)
    finally:
        client.loop_stop()
        client.disconnect()
    return answers[0] if answers else None


def test_an_mqtt5_client_resuming_a_session_is_refused_at_once(broker_port: int) -> None:
    properties = Properties(PacketTypes.CONNECT)
    properties.SessionExpiryInterval = 3600
    started = time.monotonic()
    answer = _first_connack(broker_port, mqtt.MQTTv5, clean_start=False, properties=properties)
    assert answer == "Unsupported protocol version", answer
    assert time.monotonic() - started < 5


def test_mqtt_3_1_1_clients_still_connect(broker_port: int) -> None:
    assert _first_connack(broker_port, mqtt.MQTTv311) == "Success"

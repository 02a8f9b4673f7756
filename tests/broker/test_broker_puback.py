"""A publisher's PUBACK/PUBREC through `mqds broker` comes only once mqds stored the message.

Real 3-node cluster, `mqds broker` processes (one per test: some are killed
with SIGKILL), paho-mqtt publishers. amqtt alone acknowledges a QoS 1 publish
when it queues it and a QoS 2 publish when it arrives; a broker killed right
after a burst's last PUBACK then lost about a sixth of the burst.
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from harness import MQDS, cluster_up

from mqds.client import Client
from mqds.tools.ports import free_port
from mqds.tools.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N = 1000
# Only stored/# is stored: free/# is a topic no rule stores.
PARTIAL_HOOKS = """
[[rule]]
hook = "message.publish"
topic = "stored/#"
action = "on_message_publish"
"""


class Broker:
    """One `mqds broker` process."""

    def __init__(self, workdir: Path, endpoints: str, *extra: str) -> None:
        self.port = free_port()
        self.out_path = workdir / f"broker-{self.port}.out"
        args = [MQDS, "broker", "--endpoints", endpoints, "--listen", f"127.0.0.1:{self.port}", *extra]
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"mqds broker exited with {self.proc.returncode}:\n{self.output()}")
            return "mqds broker: ready" in self.output()

        wait_until("mqds broker ready", ready, 30)

    def output(self) -> str:
        return self.out_path.read_text(errors="replace") if self.out_path.exists() else ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL: nothing of the broker runs after this
            self.proc.wait(10)

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(30) == 0, self.output()
        return self.output()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Client]]:
    data_dir = tmp_path_factory.mktemp("broker-puback") / "cluster"
    with cluster_up(data_dir, 4) as endpoints, Client(endpoints, timeout_s=30) as client:
        yield endpoints, client


@pytest.fixture
def start_broker(tmp_path: Path) -> Iterator[Callable[..., Broker]]:
    started: list[Broker] = []

    def start(endpoints: str, *extra: str) -> Broker:
        broker = Broker(tmp_path, endpoints, *extra)
        started.append(broker)
        return broker

    yield start
    for broker in started:
        broker.kill()


class Publisher:
    """A paho-mqtt 2 publisher that records which of its publishes the broker acknowledged, and how."""

    def __init__(self, port: int, clientid: str, *, max_inflight: int = 100) -> None:
        self.lock = threading.Lock()
        self.acked: set[int] = set()  # mids: PUBACK (QoS 1) or PUBCOMP (QoS 2)
        self.pubrec: set[int] = set()  # mids of QoS 2 publishes that got their PUBREC
        self.disconnected = threading.Event()
        connected = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=clientid, clean_session=True)
        self.client.max_inflight_messages_set(max_inflight)
        self.client.max_queued_messages_set(0)
        self.client.on_connect = lambda *_: connected.set()
        self.client.on_disconnect = lambda *_: self.disconnected.set()
        self.client.on_publish = self._on_publish
        self.client.on_log = self._on_log
        self.client.connect("127.0.0.1", port, keepalive=30)
        self.client.loop_start()
        assert connected.wait(10), f"{clientid} did not connect"

    def _on_publish(self, client: object, userdata: object, mid: int, reason: object, props: object) -> None:
        with self.lock:
            self.acked.add(mid)

    def _on_log(self, client: object, userdata: object, level: int, buf: str) -> None:
        found = re.match(r"Received PUBREC \(Mid: (\d+)\)", buf)
        if found:
            with self.lock:
                self.pubrec.add(int(found.group(1)))

    def publish(self, topic: str, payload: str, qos: int = 1) -> int:
        info = self.client.publish(topic, payload, qos=qos)
        assert info.rc == mqtt.MQTT_ERR_SUCCESS
        return info.mid

    def wait(self, what: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if what():
                    return True
            time.sleep(0.002)
        return False

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def stored_payloads(client: Client, topic_filter: str) -> list[str]:
    return [m.payload.decode() for m in client.replay(topic_filter)]


def burst_then_kill(cluster: tuple[str, Client], broker: Broker, topic: str, qos: int) -> None:
    """N publishes pipelined; SIGKILL the broker the moment the last acknowledgement arrived; all must be stored."""
    client = cluster[1]
    publisher = Publisher(broker.port, f"puback-{qos}")
    mids = {publisher.publish(topic, str(i), qos=qos): str(i) for i in range(N)}
    acknowledged = publisher.pubrec if qos == 2 else publisher.acked
    assert publisher.wait(lambda: len(acknowledged) == N, 60), f"{len(acknowledged)} of {N} acknowledged"
    broker.kill()
    with publisher.lock:
        acked = [mids[mid] for mid in sorted(acknowledged)]
    publisher.client.loop_stop()
    stored = stored_payloads(client, topic)
    missing = sorted(set(acked) - set(stored), key=int)
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged messages not stored, e.g. {missing[:10]}"
    assert stored == [str(i) for i in range(N)], "stored out of order or twice"


def test_every_pubacked_qos1_message_survives_kill_9(
    cluster: tuple[str, Client], start_broker: Callable[..., Broker]
) -> None:
    burst_then_kill(cluster, start_broker(cluster[0]), "puback/qos1/dev", qos=1)


def test_every_pubreced_qos2_message_survives_kill_9(
    cluster: tuple[str, Client], start_broker: Callable[..., Broker]
) -> None:
    burst_then_kill(cluster, start_broker(cluster[0]), "puback/qos2/dev", qos=2)


def test_qos2_completes_and_is_stored_once(cluster: tuple[str, Client], start_broker: Callable[..., Broker]) -> None:
    broker = start_broker(cluster[0])
    publisher = Publisher(broker.port, "puback-qos2-once")
    for i in range(50):
        publisher.publish("puback/qos2once/dev", str(i), qos=2)
    assert publisher.wait(lambda: len(publisher.acked) == 50, 30), "not every PUBCOMP came"
    publisher.close()
    assert stored_payloads(cluster[1], "puback/qos2once/#") == [str(i) for i in range(50)]


def test_pipelined_publishes_share_store_calls(
    cluster: tuple[str, Client], start_broker: Callable[..., Broker]
) -> None:
    broker = start_broker(cluster[0])
    publisher = Publisher(broker.port, "puback-batching", max_inflight=100)
    for i in range(N):
        publisher.publish("puback/batching/dev", str(i))
    assert publisher.wait(lambda: len(publisher.acked) == N, 60)
    publisher.close()
    summary = broker.stop()
    found = re.search(r"(\d+) messages stored in (\d+) calls", summary)
    assert found is not None, summary
    stored, calls = int(found.group(1)), int(found.group(2))
    assert stored == N
    # One store call per message would be N calls; 100 in flight share waves (at most 64 each). How
    # full a wave is depends on how fast the broker reads publishes against how fast a store call
    # returns: on a loaded CI machine the waves measured 3.8 messages on average (261 calls), so the
    # bound asks only that calls are shared at all, twice over.
    assert calls <= N // 2, f"{calls} store calls for {N} pipelined messages: not batched"


def test_a_failed_store_is_not_acknowledged_and_nothing_after_it(
    tmp_path: Path, start_broker: Callable[..., Broker]
) -> None:
    # No mqds answers at this address: the store of stored/# fails after --timeout.
    hooks = tmp_path / "hooks.toml"
    hooks.write_text(PARTIAL_HOOKS)
    broker = start_broker("127.0.0.1:1", "--hooks", str(hooks), "--timeout", "2")

    free = Publisher(broker.port, "puback-free")
    started = time.monotonic()
    free.publish("free/a", "x")  # no rule stores it: acknowledged at once, as amqtt does
    assert free.wait(lambda: len(free.acked) == 1, 5)
    assert time.monotonic() - started < 1.5

    publisher = Publisher(broker.port, "puback-fail")
    publisher.publish("stored/a", "1")
    publisher.publish("free/b", "2")  # needs no store, but must not be acknowledged before stored/a
    assert publisher.disconnected.wait(20), "the broker did not close the connection after the failed store"
    assert publisher.acked == set(), "a publish was acknowledged although stored/a was not stored"
    publisher.client.loop_stop()
    broker.kill()
    assert "not stored in mqds: not acknowledged; closing the connection" in broker.output()


def test_early_puback_opt_out_acknowledges_before_the_store(
    tmp_path: Path, start_broker: Callable[..., Broker]
) -> None:
    hooks = tmp_path / "hooks.toml"
    hooks.write_text(PARTIAL_HOOKS)
    broker = start_broker("127.0.0.1:1", "--hooks", str(hooks), "--timeout", "2", "--early-puback")
    publisher = Publisher(broker.port, "puback-early")
    publisher.publish("stored/a", "1")  # mqds is unreachable: acknowledged anyway (amqtt's behaviour)
    assert publisher.wait(lambda: len(publisher.acked) == 1, 5)
    publisher.close()

"""Shared subscriptions through `mqds broker`: a real 3-node cluster, the broker as a process, paho clients.

``$share/<group>/<filter>`` is served by the cluster's share groups: each
message to one member of the group, a plain subscriber still gets every
message, and what a member took and never acknowledged reaches another member.
The broker runs with a short ack wait and poll interval so each test takes a
few seconds; the rules are the built-in ones (every QoS 1/2 message stored).
"""

from __future__ import annotations

import collections
import contextlib
import queue
import time
from collections.abc import Callable, Iterator

import pytest
from harness import cluster_up
from mqtt_support import BrokerProcess, Mqtt, Received

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N_SHARDS = 4
ACK_WAIT_MS = 1500


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    data_dir = tmp_path_factory.mktemp("broker-shared") / "cluster"
    with cluster_up(data_dir, N_SHARDS) as endpoints:
        process = BrokerProcess(tmp_path_factory.mktemp("broker"), endpoints, None, "broker-shared")
        process.args += ["--queue-ack-wait-ms", str(ACK_WAIT_MS), "--shared-poll-ms", "200"]
        with process.running():
            yield process


@pytest.fixture
def connect(broker: BrokerProcess) -> Iterator[Callable[..., Mqtt]]:
    """connect(clientid, manual_ack=..., clean_session=...): a connected client (clean by default), closed after."""
    with contextlib.ExitStack() as made:

        def make(clientid: str, *, manual_ack: bool = False, clean_session: bool = True) -> Mqtt:
            client = Mqtt(broker.port, clientid, clean_session=clean_session, manual_ack=manual_ack)
            made.callback(client.close)
            return client

        yield make


def collect(members: list[Mqtt], total: int, timeout_s: float = 20) -> dict[str, list[Received]]:
    """What each member received until ``total`` messages arrived among them all, then a quiet second (nothing
    must come twice, so more than ``total`` is counted too)."""
    got: dict[str, list[Received]] = {m.clientid: [] for m in members}
    deadline = time.monotonic() + timeout_s
    while sum(map(len, got.values())) < total and time.monotonic() < deadline:
        for member in members:
            with contextlib.suppress(queue.Empty):
                got[member.clientid].append(member.messages.get(timeout=0.05))
    for member in members:
        got[member.clientid] += member.quiet(0)
    time.sleep(1)
    for member in members:
        got[member.clientid] += member.quiet(0)
    return got


def test_each_message_reaches_one_member_and_a_plain_subscriber_gets_all(connect: Callable[..., Mqtt]) -> None:
    first, second = connect("share-a"), connect("share-b")
    plain = connect("share-plain")
    assert first.subscribe("$share/g1/sh/one/#") == 1
    assert second.subscribe("$share/g1/sh/one/#") == 1
    assert plain.subscribe("sh/one/#") == 1
    publishers = [connect(f"share-pub-{i}") for i in range(4)]  # four senders: spread over the shards
    sent = []
    for i in range(10):
        for p, publisher in enumerate(publishers):
            payload = f"{p}-{i}"
            publisher.publish(f"sh/one/{p}", payload)
            sent.append(payload)

    got = collect([first, second], len(sent))
    shared = [payload.decode() for messages in got.values() for _, payload, _, _ in messages]
    duplicates = [p for p, n in collections.Counter(shared).items() if n > 1]
    assert not duplicates, f"delivered to more than one member (or twice): {duplicates}"
    assert sorted(shared) == sorted(sent), {k: len(v) for k, v in got.items()}
    assert all(qos == 1 and not retain for messages in got.values() for _, _, qos, retain in messages)
    # Each publisher's messages come in the order it sent them (one shard, one member at a time).
    for messages in got.values():
        for p in range(len(publishers)):
            mine = [payload.decode() for _, payload, _, _ in messages if payload.decode().startswith(f"{p}-")]
            assert mine == sorted(mine, key=lambda s: int(s.split("-")[1])), mine
    # The plain subscriber is not a member: it gets every message, once.
    everything = [payload.decode() for _, payload, _, _ in plain.take(len(sent))]
    assert sorted(everything) == sorted(sent)
    assert plain.quiet(0.5) == []


def test_what_a_member_took_and_never_acknowledged_reaches_another_member(connect: Callable[..., Mqtt]) -> None:
    taker = connect("share-taker", manual_ack=True)  # receives, never sends PUBACK
    assert taker.subscribe("$share/g2/sh/two/#") == 1  # alone in the group: it reads every shard
    publisher = connect("share-pub-two")
    sent = [f"m{i}" for i in range(5)]
    for payload in sent:
        publisher.publish("sh/two/x", payload)
    # It never acknowledges, so a slow run may give it a message again after the ack wait: each at least once.
    taken: set[str] = set()
    deadline = time.monotonic() + 20
    while taken != set(sent) and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            taken.add(taker.messages.get(timeout=0.1)[1].decode())
    assert taken == set(sent)

    other = connect("share-other")
    assert other.subscribe("$share/g2/sh/two/#") == 1
    taker.drop()  # gone without acknowledging
    started = time.monotonic()
    redelivered = other.take(len(sent), timeout_s=ACK_WAIT_MS / 1000 + 10)
    assert sorted(p.decode() for _, p, _, _ in redelivered) == sorted(sent)
    assert time.monotonic() - started < ACK_WAIT_MS / 1000 + 10
    assert other.quiet(1) == []  # each once


def test_a_queue_alias_and_unsubscribe(connect: Callable[..., Mqtt]) -> None:
    member, spare = connect("share-q1"), connect("share-q2")
    assert member.subscribe("$queue/sh/three/#") == 1  # EMQX's $queue/: the group $queue
    publisher = connect("share-pub-three")
    publisher.publish("sh/three/a", "one")
    assert member.take(1) == [("sh/three/a", b"one", 1, False)]
    member.client.unsubscribe("$queue/sh/three/#")
    assert spare.subscribe("$queue/sh/three/#") == 1
    time.sleep(0.5)  # the unsubscribe left the group
    publisher.publish("sh/three/a", "two")
    assert spare.take(1) == [("sh/three/a", b"two", 1, False)]
    assert member.quiet(0.5) == []


def test_a_persistent_sessions_shared_subscription_comes_back_with_its_session(connect: Callable[..., Mqtt]) -> None:
    member = connect("share-persistent", clean_session=False)
    assert member.subscribe("$share/g4/sh/four/#") == 1
    member.close()  # the member leaves; the group keeps its position
    publisher = connect("share-pub-four")
    publisher.publish("sh/four/a", "while-away")
    again = connect("share-persistent", clean_session=False)
    assert again.session_present
    # The broker kept the session's shared subscription: the member joins again and gets what the group
    # has not delivered, without a SUBSCRIBE.
    assert again.take(1) == [("sh/four/a", b"while-away", 1, False)]
    publisher.publish("sh/four/a", "live")
    assert again.take(1) == [("sh/four/a", b"live", 1, False)]
    assert again.quiet(0.5) == []

"""Server-side redelivery (issue 47) on a real 3-node cluster: ack wait, max deliveries, backoff, max unacked,
dead letters, nacks, and delivery counts that a leader kill neither resets nor doubles.

Each consumer here reads one shard (its messages come from one sender), so the
shard whose leader logs its deliveries is known; the waits are the leader's
clock, which every node of a local cluster shares.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from mqds.client import Client, Message, SharedSubscription
from mqds.client.model import Delivered
from mqds.protocol.delivery import Policy
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import sessions_pb2_grpc as spb_grpc

pytestmark = pytest.mark.integration

N_SHARDS = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Three nodes, four shards: each shard's leader is one node, its followers the two others."""
    nodes = LocalCluster(tmp_path_factory.mktemp("redelivery") / "nodes", 3, n_shards=N_SHARDS)
    with nodes:
        nodes.start()
        yield nodes


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[Client]:
    with cluster.client(timeout_s=30) as consumer:
        yield consumer


def got(delivered: Delivered) -> list[tuple[bytes, int]]:
    """(payload, deliveries so far) of each message a call returned."""
    return [(m.payload, n) for m, n in zip(delivered.messages, delivered.deliveries, strict=True)]


@dataclass
class Consumer:
    """A consumer (clientid, filter) with its policy, reading the one shard its sender's messages are in."""

    client: Client
    clientid: str
    topic_filter: str
    policy: Policy
    shard: int
    queue: bool = False

    def deliver(self, max_count: int = 10) -> Delivered:
        return self.client.deliver(
            self.clientid, self.topic_filter, self.policy, max_count, queue=self.queue, shards=[self.shard]
        )

    def ack(self, message: Message) -> None:
        self.client.ack(self.clientid, self.topic_filter, message, mode="queue" if self.queue else "delivery")

    def nack(self, message: Message) -> None:
        self.client.nack(self.clientid, self.topic_filter, message)


def stored(client: Client, sender: str, topic: str, count: int) -> int:
    """Store ``count`` QoS 1 messages (payloads b"0", b"1", ...) from one sender; the shard they are in."""
    client.store_batch([Message(topic, b"%d" % i, sender=sender, qos=1) for i in range(count)])
    return shard_of(sender, N_SHARDS)


def reading(client: Client, sender: str, topic: str, count: int, clientid: str, **policy: object) -> Consumer:
    """``stored`` messages, and a consumer of exactly their topic with the policy ``Policy.of(**policy)``."""
    shard = stored(client, sender, topic, count)
    return Consumer(client, clientid, topic, Policy.of(**policy), shard)  # type: ignore[arg-type]


def sleep_until(deadline: float) -> None:
    """Wait until ``deadline`` (time.monotonic()): an ack wait counted from a call, however long the calls after it
    took."""
    time.sleep(max(0.0, deadline - time.monotonic()))


def letters(client: Client, topic: str) -> list[Message]:
    return client.fetch_offline("auditor", topic, max_count=10)


def test_an_unacknowledged_message_comes_back_after_its_ack_wait_counted(client: Client) -> None:
    worker = reading(client, "rd-wait", "rd/wait", 3, "worker-1", ack_wait_ms=1_500, max_deliveries=5)
    first = worker.deliver()
    due = time.monotonic() + 1.6
    assert got(first) == [(b"0", 1), (b"1", 1), (b"2", 1)] and first.unacked == 3
    assert worker.deliver().messages == []  # in flight, not due yet: nothing new either
    worker.ack(first.messages[1])
    sleep_until(due)
    again = worker.deliver()
    assert got(again) == [(b"0", 2), (b"2", 2)] and again.unacked == 2  # the acknowledged one never returns
    worker.ack(again.messages[0])
    time.sleep(1.6)
    assert got(worker.deliver()) == [(b"2", 3)]
    # Another consumer of the same filter has deliveries of its own.
    other = Consumer(client, "worker-2", "rd/wait", worker.policy, worker.shard)
    assert got(other.deliver()) == [(b"0", 1), (b"1", 1), (b"2", 1)]


def test_max_unacked_limits_what_a_call_returns(client: Client) -> None:
    worker = reading(client, "rd-pending", "rd/pending", 10, "w", ack_wait_ms=60_000, max_deliveries=5, max_unacked=4)
    first = worker.deliver(100)
    assert [m.payload for m in first.messages] == [b"0", b"1", b"2", b"3"] and first.unacked == 4
    assert worker.deliver(100).messages == []
    for m in first.messages[:2]:
        worker.ack(m)
    more = worker.deliver(100)
    assert got(more) == [(b"4", 1), (b"5", 1)] and more.unacked == 4
    for m in [*first.messages[2:], *more.messages]:  # max_count bounds a call too
        worker.ack(m)
    assert [m.payload for m in worker.deliver(1).messages] == [b"6"]


def test_after_its_last_delivery_a_message_goes_to_the_dead_letter_topic_once(client: Client) -> None:
    shard = stored(client, "rd-dead", "rd/orders/1", 2)
    policy = Policy.of(ack_wait_ms=300, max_deliveries=2, dead_letter_topic="rd-dlq/orders")
    billing = Consumer(client, "billing", "rd/orders/+", policy, shard)
    first = billing.deliver()
    assert got(first) == [(b"0", 1), (b"1", 1)]
    billing.ack(first.messages[1])
    time.sleep(0.4)
    assert got(billing.deliver()) == [(b"0", 2)]
    time.sleep(0.4)
    last = billing.deliver()
    assert last.messages == [] and last.dead_lettered == 1 and last.unacked == 0
    time.sleep(0.4)
    assert billing.deliver().messages == []  # gone from the consumer
    (letter,) = letters(client, "rd-dlq/#")
    assert letter.payload == b"0" and letter.sender == "rd-dead" and letter.shard == shard
    props = dict(letter.properties)
    assert props["mqds-dead-letter-topic"] == "rd/orders/1" and props["mqds-deliveries"] == "2"
    assert props["mqds-dead-letter-consumer"] == "billing rd/orders/+"


def test_backoff_spaces_the_deliveries(client: Client) -> None:
    slow = reading(
        client, "rd-backoff", "rd/backoff", 1, "slow", ack_wait_ms=60_000, max_deliveries=10, backoff_ms=[300, 2_000]
    )
    assert got(slow.deliver()) == [(b"0", 1)]
    time.sleep(0.4)
    assert got(slow.deliver()) == [(b"0", 2)]  # after backoff[0]
    time.sleep(0.4)
    assert got(slow.deliver()) == []  # the second wait is backoff[1], 2 s
    time.sleep(1.8)
    assert got(slow.deliver()) == [(b"0", 3)]


def test_share_groups_and_queue_readers_acknowledge_apart(client: Client) -> None:
    shard = stored(client, "rd-groups", "rd/jobs", 2)
    policy = Policy.of(ack_wait_ms=300, max_deliveries=5)
    a, b = (Consumer(client, f"$share/{group}", "rd/jobs", policy, shard) for group in "ab")
    from_a = a.deliver()
    assert got(from_a) == got(b.deliver()) == [(b"0", 1), (b"1", 1)]
    for m in from_a.messages:
        a.ack(m)
    time.sleep(0.4)
    assert a.deliver().messages == []
    assert got(b.deliver()) == [(b"0", 2), (b"1", 2)]
    # Queue readers: a queue acknowledgement ends the reader's delivery and removes the message for all of them.
    q1, q2 = (Consumer(client, reader, "rd/jobs", policy, shard, queue=True) for reader in ("q1", "q2"))
    first = q1.deliver()
    assert got(first) == [(b"0", 1), (b"1", 1)]
    q1.ack(first.messages[0])
    assert got(q2.deliver()) == [(b"1", 1)]
    time.sleep(0.4)
    assert got(q1.deliver()) == [(b"1", 2)]


def test_a_nack_makes_a_delivery_due_at_once_with_its_count_kept(client: Client) -> None:
    worker = reading(
        client, "rd-nack", "rd/nack", 2, "n", ack_wait_ms=60_000, max_deliveries=2, dead_letter_topic="rd-dlq/nack"
    )
    first = worker.deliver()
    assert got(first) == [(b"0", 1), (b"1", 1)]
    worker.nack(first.messages[0])
    again = worker.deliver()
    assert got(again) == [(b"0", 2)]  # at once, not after the minute's ack wait
    worker.nack(again.messages[0])
    last = worker.deliver()
    assert last.messages == [] and last.dead_lettered == 1 and last.unacked == 1
    worker.nack(again.messages[0])  # no longer in flight: nothing happens
    assert worker.deliver().messages == []
    assert [m.payload for m in letters(client, "rd-dlq/nack")] == [b"0"]
    # A delivery given back as never received (a broker lost the connection before sending it) is not counted:
    # b"1", delivered once and not due for a minute, comes again at once as a first delivery.
    client.nack("n", "rd/nack", first.messages[1], received=False)
    assert got(worker.deliver()) == [(b"1", 1)]


def test_a_message_past_its_expiry_interval_is_not_delivered_again(client: Client) -> None:
    client.store_batch(
        [
            Message("rd/expiry", b"short", sender="rd-expiry", qos=1, message_expiry_s=1),
            Message("rd/expiry", b"long", sender="rd-expiry", qos=1),
        ]
    )
    policy = Policy.of(ack_wait_ms=300, max_deliveries=5, dead_letter_topic="rd-dlq/expiry")
    worker = Consumer(client, "e", "rd/expiry", policy, shard_of("rd-expiry", N_SHARDS))
    first = worker.deliver()
    assert got(first) == [(b"short", 1), (b"long", 1)]
    assert first.messages[0].message_expiry_s == 1 and first.messages[1].message_expiry_s == 0
    time.sleep(1.2)
    again = worker.deliver()
    assert got(again) == [(b"long", 2)] and again.unacked == 1 and again.dead_lettered == 0
    assert letters(client, "rd-dlq/expiry") == []


def test_bad_policies_are_refused_and_change_nothing(client: Client, cluster: LocalCluster) -> None:
    shard = stored(client, "rd-bad", "rd/bad", 1)

    def policy(**change: object) -> spb.DeliveryPolicy:
        fields: dict[str, object] = {"ack_wait_ms": 1000, "max_deliveries": 3, "max_unacked": 10}
        return spb.DeliveryPolicy(**(fields | change))  # type: ignore[arg-type]

    bad: list[tuple[spb.DeliveryPolicy | None, str]] = [
        (None, "policy is missing"),
        (policy(ack_wait_ms=0), "ack_wait_ms 0"),
        (policy(ack_wait_ms=86_400_001), "ack_wait_ms 86400001"),
        (policy(max_deliveries=0), "max_deliveries 0"),
        (policy(max_deliveries=1_000_000), "max_deliveries 1000000"),
        (policy(max_unacked=0), "max_unacked 0"),
        (policy(backoff_ms=[5, 0]), "backoff_ms[1] 0"),
        (policy(dead_letter_topic="dlq/#"), "dlq/#"),
        (policy(dead_letter_topic="rd/bad"), "matches the consumer's filter"),
    ]
    leader = cluster.leader(shard)
    assert leader is not None
    with grpc.insecure_channel(cluster.nodes[leader].address) as channel:
        stub = spb_grpc.SessionsStub(channel)
        for wrong, says in bad:
            request = spb.DeliverRequest(clientid="careful", topic_filter="rd/bad", shards=[shard], max_count=5)
            if wrong is not None:
                request.policy.CopyFrom(wrong)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Deliver(request, timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (says, caught.value)
            assert says in (caught.value.details() or ""), (says, caught.value.details())
        for clientid, topic_filter, max_count in (
            ("careful", "rd/#/x", 5),
            ("", "rd/bad", 5),
            ("careful", "rd/bad", 0),
        ):
            request = spb.DeliverRequest(
                clientid=clientid, topic_filter=topic_filter, policy=policy(), max_count=max_count, shards=[shard]
            )
            with pytest.raises(grpc.RpcError) as caught:
                stub.Deliver(request, timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        with pytest.raises(grpc.RpcError) as caught:  # as for every call that names a shard
            stub.Deliver(
                spb.DeliverRequest(clientid="careful", topic_filter="rd/bad", policy=policy(), max_count=5, shards=[99])
            )
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as caught:
            unknown_mode = spb.AckRequest(clientid="careful", topic_filter="rd/bad", shard=shard, timestamp_us=1)
            unknown_mode.mode = 7  # type: ignore[assignment]  # an enum value no version has
            stub.Ack(unknown_mode)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Nothing was logged for the consumer: its first delivery is the first.
    careful = Consumer(client, "careful", "rd/bad", Policy.of(ack_wait_ms=1000, max_deliveries=3), shard)
    assert got(careful.deliver(5)) == [(b"0", 1)]


def test_edge_values_are_answered_within_bounds(client: Client, cluster: LocalCluster) -> None:
    shard = stored(client, "rd-edge", "rd/edge", 3)
    leader = cluster.leader(shard)
    assert leader is not None
    most = spb.DeliveryPolicy(
        ack_wait_ms=86_400_000, max_deliveries=1_000, max_unacked=10_000, backoff_ms=[86_400_000] * 100
    )
    with grpc.insecure_channel(cluster.nodes[leader].address) as channel:
        stub = spb_grpc.SessionsStub(channel)
        late = spb.DeliverRequest(
            clientid="edge-late", topic_filter="rd/edge", shards=[shard], policy=most, max_count=5
        )
        late.start_after_us = (1 << 64) - 1  # after every timestamp there can be
        assert not stub.Deliver(late, timeout=10).messages
        many = spb.DeliverRequest(
            clientid="edge-many", topic_filter="#", shards=[shard], policy=most, max_count=(1 << 32) - 1
        )
        answer = stub.Deliver(many, timeout=10)
        assert [m.payload for m in answer.messages if m.topic == "rd/edge"] == [b"0", b"1", b"2"]
        assert list(answer.deliveries) == [1] * len(answer.messages) and answer.unacked == len(answer.messages)


def test_a_leader_kill_neither_resets_nor_doubles_a_delivery_count(client: Client, cluster: LocalCluster) -> None:
    survivor = reading(client, "rd-failover", "rd/failover", 1, "survivor", ack_wait_ms=500, max_deliveries=10)
    shard = survivor.shard
    assert got(survivor.deliver()) == [(b"0", 1)]
    time.sleep(0.6)
    assert got(survivor.deliver()) == [(b"0", 2)]
    victim = cluster.leader(shard)
    assert victim is not None
    cluster.kill(victim)  # kill -9
    try:
        cluster.wait_for_leader(shard, exclude=[victim])
        time.sleep(0.6)
        assert got(survivor.deliver()) == [(b"0", 3)]  # the new leader applied the same deliveries: it goes on
    finally:
        cluster.start_node(victim)
    time.sleep(0.6)
    assert got(survivor.deliver()) == [(b"0", 4)]
    cluster.assert_replicas_identical(timeout_s=60)


def test_what_a_share_group_member_left_unacknowledged_goes_to_another(client: Client) -> None:
    policy = Policy.of(ack_wait_ms=2_000, max_deliveries=5)
    a = SharedSubscription(client, "rd-pool", "rd/pool/#", "m-a", policy=policy)
    b = SharedSubscription(client, "rd-pool", "rd/pool/#", "m-b", policy=policy)
    a.join()
    client.store_batch([Message("rd/pool/x", b"%d" % i, sender=f"rd-pool-{i}", qos=1) for i in range(12)])
    taken = a.fetch(100)  # alone: every shard
    due = time.monotonic() + 2.1
    assert sorted(m.payload for m in taken) == sorted(b"%d" % i for i in range(12))
    for m in taken[:4]:
        a.ack(m)
    a.leave()  # the other eight were never acknowledged
    b.join()
    assert sorted(b.shards) == list(range(N_SHARDS))
    assert b.fetch(100) == []  # in flight (a's), not due yet
    sleep_until(due)
    again = b.fetch(100)
    assert sorted(m.payload for m in again) == sorted(m.payload for m in taken[4:])
    for m in again:
        b.ack(m)
    time.sleep(2.1)
    assert b.fetch(100) == []

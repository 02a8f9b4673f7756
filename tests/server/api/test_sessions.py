"""Broker state on a real 3-node cluster: client state, proxy subscriptions, retained messages, offline delivery.

Every feature is checked through the client library against real nodes, and
then again after the leader of the shard that holds it was killed: it is
replicated like the messages, so nothing a call acknowledged may be lost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest

from mqds.client import Client, Message, aio
from mqds.client import errors as E
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import sessions_pb2_grpc as spb_grpc
from mqds.v1 import storage_pb2 as pb

pytestmark = pytest.mark.integration

N_SHARDS = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("sessions") / "c", 3, n_shards=N_SHARDS) as c:
        c.start()
        yield c


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster.addresses, timeout_s=30) as c:
        yield c


def publish(client: Client, topic: str, payloads: list[str], qos: int = 1, senders: int = 5) -> list[Message]:
    """Store messages from several senders (so several shards), in order; return them as stored."""
    batch = [Message(topic, p.encode(), sender=f"pub-{i % senders}", qos=qos) for i, p in enumerate(payloads)]
    return client.store_batch(batch)


def payloads(messages: list[Message]) -> list[str]:
    return [m.payload.decode() for m in messages]


def test_client_state_follows_connect_and_disconnect(client: Client) -> None:
    assert client.client_state("cs-1") is None
    online = client.client_connected("cs-1", "broker-1")
    assert (online.clientid, online.online, online.node, online.offline_at_us) == ("cs-1", True, "broker-1", 0)
    client.client_connected("cs-2", "broker-1")
    client.client_connected("cs-3", "broker-2")
    assert client.clients_on_node("broker-1") == ["cs-1", "cs-2"]
    assert client.clients_on_node("broker-2") == ["cs-3"]

    # A late disconnect from a broker the client is not on changes nothing.
    assert client.client_disconnected("cs-1", node="broker-9") is None
    assert client.client_state("cs-1") == online
    offline = client.client_disconnected("cs-1", node="broker-1")
    assert offline is not None and not offline.online and offline.node == "broker-1"
    assert offline.online_at_us == online.online_at_us < offline.offline_at_us
    assert client.clients_on_node("broker-1") == ["cs-2"]

    # Reconnecting elsewhere moves the client between node lists.
    moved = client.client_connected("cs-2", "broker-2")
    assert moved.node == "broker-2" and moved.offline_at_us == 0
    assert client.clients_on_node("broker-1") == []
    assert client.clients_on_node("broker-2") == ["cs-2", "cs-3"]
    assert client.client_disconnected("never-seen") is None


def test_proxy_subscriptions(client: Client) -> None:
    assert client.subscriptions("sub-a") == {}
    client.subscribe("sub-a", "sub-a/downlink", qos=1)
    client.subscribe("sub-a", "sub-a/upstream", qos=2)
    client.subscribe("sub-a", "cmd/+/all", qos=0)
    client.subscribe("sub-a", "sub-a/downlink", qos=2)  # changes the QoS
    assert client.subscriptions("sub-a") == {"cmd/+/all": 0, "sub-a/downlink": 2, "sub-a/upstream": 2}
    assert client.unsubscribe("sub-a", "cmd/+/all") is True
    assert client.unsubscribe("sub-a", "cmd/+/all") is False
    assert client.subscriptions("sub-a") == {"sub-a/downlink": 2, "sub-a/upstream": 2}
    # Another client's subscriptions are its own, even with a clientid that is a prefix.
    client.subscribe("sub-ab", "x", qos=1)
    assert client.subscriptions("sub-a") == {"sub-a/downlink": 2, "sub-a/upstream": 2}
    assert client.subscriptions("sub-ab") == {"x": 1}


def test_retained_messages(client: Client) -> None:
    stored = client.retain(Message("ret/42/status", b"on", sender="dev-42", qos=1, properties=[("unit", "x")]))
    assert stored is not None and stored.retain and stored.timestamp_us and stored.shard is not None
    assert stored.shard == shard_of("ret/42/status", N_SHARDS)
    client.retain(Message("ret/43/status", b"off", sender="dev-43"))
    client.retain(Message("ret/43", b"parent", sender="dev-43"))
    client.retain(Message("$SYS/ret/uptime", b"1", sender="broker"))
    client.retain(Message("ret/42/status", b"on again", sender="dev-42", qos=2))  # replaces

    found = client.retained("ret/+/status")
    assert [(m.topic, m.payload, m.qos) for m in found] == [
        ("ret/42/status", b"on again", 2),
        ("ret/43/status", b"off", 0),
    ]
    assert [m.topic for m in client.retained("ret/43/#")] == ["ret/43", "ret/43/status"]
    assert [m.topic for m in client.retained("ret/42/status")] == ["ret/42/status"]
    # A filter starting with a wildcard does not match $-topics; one naming $SYS does.
    assert "$SYS/ret/uptime" not in [m.topic for m in client.retained("#")]
    assert [m.topic for m in client.retained("$SYS/#")] == ["$SYS/ret/uptime"]

    # An empty payload deletes the retained message.
    assert client.retain(Message("ret/43/status", b"")) is None
    assert [m.topic for m in client.retained("ret/+/status")] == ["ret/42/status"]
    assert client.retain(Message("ret/never", b"")) is None


def test_pubsub_offline_messages_follow_each_subscribers_read_position(client: Client) -> None:
    stored = publish(client, "ps/7/cmd", [f"m{i}" for i in range(30)])
    publish(client, "ps/8/cmd", ["other"])
    publish(client, "ps/7/cmd", ["q0"], qos=0)

    first = client.fetch_offline("ps-a", "ps/7/#", max_count=10)
    everything = sorted(stored, key=lambda m: (m.timestamp_us, m.shard))
    assert payloads(first) == payloads(everything[:10])
    assert all(m.shard is not None and m.timestamp_us for m in first)
    # Fetching does not move the position: only acknowledgements do.
    assert payloads(client.fetch_offline("ps-a", "ps/7/#", max_count=10)) == payloads(first)
    for m in first:
        client.ack("ps-a", "ps/7/#", m)
    rest = client.fetch_offline("ps-a", "ps/7/#", max_count=500)
    assert payloads(rest) == payloads(everything[10:])
    # Every sender's messages come in the order they were stored.
    for sender in {m.sender for m in stored}:
        mine = [m.payload for m in rest if m.sender == sender]
        assert mine == [m.payload for m in everything[10:] if m.sender == sender]

    # Another subscriber, and the same subscriber on another filter, read from the start.
    assert len(client.fetch_offline("ps-b", "ps/7/#")) == 30
    assert len(client.fetch_offline("ps-a", "ps/+/cmd")) == 31
    # QoS 0 only on request.
    assert "q0" in payloads(client.fetch_offline("ps-b", "ps/7/#", include_qos0=True))

    for m in rest:
        client.ack("ps-a", "ps/7/#", m)
    assert client.fetch_offline("ps-a", "ps/7/#") == []
    # Forgetting the acknowledgements starts the subscriber over.
    assert client.forget_acks("ps-a", "ps/7/#") is True
    assert client.forget_acks("ps-a", "ps/7/#") is False
    assert len(client.fetch_offline("ps-a", "ps/7/#")) == 30


def test_a_subscription_started_now_reads_only_what_is_stored_after_it(client: Client) -> None:
    publish(client, "new/1/cmd", [f"before-{i}" for i in range(10)])
    # "now": the pair has no position, so it gets one started now, in every shard.
    assert client.fetch_offline("ns-a", "new/+/cmd", start="now") == []
    position = client.read_position("ns-a", "new/+/cmd")
    assert position.found and position.start_us > 0 and position.acked_us == {}
    after = publish(client, "new/1/cmd", [f"after-{i}" for i in range(10)])
    fetched = client.fetch_offline("ns-a", "new/+/cmd", start="now")
    assert sorted(payloads(fetched)) == sorted(f"after-{i}" for i in range(10))
    # Acknowledging moves on from there (shard by shard); the start still holds in the other shards.
    first = min(after, key=lambda m: (m.timestamp_us, m.shard))
    client.ack("ns-a", "new/+/cmd", first)
    assert len(client.fetch_offline("ns-a", "new/+/cmd")) == 9
    # Starting again keeps the position (a re-subscribe does not interrupt the flow).
    again = client.start_read_position("ns-a", "new/+/cmd")
    assert again.start_us == position.start_us and again.found and not again.started
    # The default reads the whole history of a pair without a position, and gives it none.
    assert len(client.fetch_offline("ns-b", "new/+/cmd")) == 20
    assert not client.read_position("ns-b", "new/+/cmd").found


def test_forgetting_a_session_deletes_its_subscriptions_and_read_positions(client: Client) -> None:
    client.client_connected("fs-1", "broker-1")
    client.subscribe("fs-1", "fs/a/#", qos=1)
    client.subscribe("fs-1", "fs/b", qos=2)
    assert client.start_read_position("fs-1", "fs/a/#").started
    client.subscribe("fs-2", "fs/a/#", qos=1)
    assert client.forget_session("fs-1") == (2, 1)
    assert client.subscriptions("fs-1") == {} and not client.read_position("fs-1", "fs/a/#").found
    assert client.subscriptions("fs-2") == {"fs/a/#": 1}
    state = client.client_state("fs-1")
    assert state is not None and state.online
    assert client.forget_session("fs-1") == (0, 0)


def test_time_range_limits_offline_messages(client: Client) -> None:
    publish(client, "tr/x", ["old-1", "old-2"])
    time.sleep(3.0)
    middle = time.time()
    publish(client, "tr/x", ["new-1", "new-2"])
    # The range reaches 1.5 s before `middle`: the new messages are in it and
    # the old ones (3 s before) are not, unless the call itself takes 1.5 s.
    time_range_s = time.time() - middle + 1.5
    # Two senders, so two shards: only each sender's own messages have an order.
    assert sorted(payloads(client.fetch_offline("tr-a", "tr/#", time_range_s=time_range_s))) == ["new-1", "new-2"]
    assert len(client.fetch_offline("tr-a", "tr/#")) == 4


def test_queue_acknowledged_messages_are_gone_for_everyone(client: Client) -> None:
    stored = publish(client, "queue/jobs", [f"job{i}" for i in range(8)])
    in_order = payloads(sorted(stored, key=lambda m: (m.timestamp_us, m.shard)))
    worker_a = client.fetch_offline("worker-a", "queue/#", mode="queue", max_count=3)
    assert payloads(worker_a) == in_order[:3]
    # Unacknowledged, they are offered again, also to another reader.
    worker_b = client.fetch_offline("worker-b", "queue/#", mode="queue", max_count=3)
    assert payloads(worker_b) == in_order[:3]
    for m in worker_a[:2]:
        client.ack("worker-a", "queue/#", m, mode="queue")
    assert payloads(client.fetch_offline("worker-b", "queue/#", mode="queue")) == in_order[2:]
    assert payloads(client.fetch_offline("worker-c", "queue/jobs", mode="queue")) == in_order[2:]
    # The messages themselves stay in the store (other readers, Spark).
    assert len(list(client.replay("queue/jobs"))) == 8


def test_bad_input_is_refused_with_a_clear_error(client: Client, cluster: LocalCluster) -> None:
    with pytest.raises(E.InvalidArgumentError, match=r"retained message: .*wildcard"):
        client.retain(Message("status/+", b"x"))
    with pytest.raises(E.InvalidArgumentError) as bad_filter:
        client.subscribe("bad-1", "a/#/b")
    assert bad_filter.value.reason.value == "INVALID_TOPIC_FILTER"
    with pytest.raises(ValueError, match="mode must be 'pubsub' or 'queue'"):
        client.fetch_offline("bad-1", "a/#", mode="fanout")
    for count in (0, -5):
        with pytest.raises(ValueError, match="max_count must be 1 or more"):
            client.fetch_offline("bad-1", "a/#", max_count=count)
    with pytest.raises(ValueError, match="qos must be 0, 1 or 2"):
        client.subscribe("bad-1", "a/#", qos=3)
    with pytest.raises(ValueError, match="needs the message's position"):
        client.ack("bad-1", "a/#", Message("a/b", b"x"))
    with pytest.raises(E.InvalidArgumentError) as empty_id:
        client.client_connected("", "broker-1")
    assert empty_id.value.reason.value == "INVALID_CLIENTID"

    # What the client library checks, the node checks too (other clients exist).
    stub = spb_grpc.SessionsStub(grpc.insecure_channel(cluster.addresses[0]))
    for request, method, detail in [
        (spb.FetchMessagesRequest(topic_filter="a/#", max_count=0), stub.FetchMessages, "max_count must be at least 1"),
        (spb.AckRequest(clientid="c", topic_filter="a/#", mode=7, timestamp_us=1), stub.Ack, "none of PUBSUB"),
        (spb.AckRequest(clientid="c", topic_filter="a/#"), stub.Ack, "timestamp_us is 0"),
        (spb.SubscribeRequest(clientid="c", topic_filter="a", qos=3), stub.Subscribe, "qos must be 0, 1 or 2"),
        (spb.ClientConnectedRequest(clientid="c"), stub.ClientConnected, "node is empty"),
        (spb.RetainRequest(message=pb.Message(topic="")), stub.Retain, "retained message"),
    ]:
        with pytest.raises(grpc.RpcError) as failed:
            method(request, timeout=10)
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
        assert detail in (failed.value.details() or ""), failed.value.details()


def test_asyncio_client_has_the_same_methods(cluster: LocalCluster) -> None:
    async def scenario() -> None:
        async with aio.Client(cluster.addresses, timeout_s=30) as c:
            assert (await c.client_connected("aio-1", "broker-a")).online
            assert await c.clients_on_node("broker-a") == ["aio-1"]
            await c.subscribe("aio-1", "aio/cmd/#", qos=1)
            assert await c.subscriptions("aio-1") == {"aio/cmd/#": 1}
            await c.retain(Message("aio/status", b"up", sender="aio-1"))
            assert [m.payload for m in await c.retained("aio/+")] == [b"up"]
            await c.store_batch([Message("aio/cmd/1", b"go", sender="ctl", qos=1)])
            (fetched,) = await c.fetch_offline("aio-1", "aio/cmd/#")
            await c.ack("aio-1", "aio/cmd/#", fetched)
            assert await c.fetch_offline("aio-1", "aio/cmd/#") == []
            assert not (await c.client_disconnected("aio-1")).online  # type: ignore[union-attr]

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_broker_state_survives_killing_the_leaders_that_hold_it(client: Client, cluster: LocalCluster) -> None:
    clientid = "durable-1"
    client.client_connected(clientid, "broker-7")
    client.subscribe(clientid, "dur/#", qos=1)
    client.retain(Message("dur/status", b"kept", sender="dev"))
    stored = publish(client, "dur/x", [f"d{i}" for i in range(6)])
    for m in sorted(stored, key=lambda m: (m.timestamp_us, m.shard))[:2]:
        client.ack(clientid, "dur/#", m)

    victim = cluster.leader(shard_of(clientid, N_SHARDS))
    assert victim is not None
    cluster.kill(victim)
    try:
        # Same answers from the new leaders, right after the failover.
        state = client.client_state(clientid)
        assert state is not None and state.online and state.node == "broker-7"
        assert client.subscriptions(clientid) == {"dur/#": 1}
        assert [m.payload for m in client.retained("dur/status")] == [b"kept"]
        assert len(client.fetch_offline(clientid, "dur/#")) == 4
        client.client_disconnected(clientid)
    finally:
        cluster.start_node(victim)
    # Every replica applied the same changes: identical digests, broker state included.
    cluster.assert_replicas_identical(timeout_s=60)
    state = client.client_state(clientid)
    assert state is not None and not state.online

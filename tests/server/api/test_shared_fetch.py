"""Offline delivery for many sessions at once, on a real 3-node cluster: ``fetch_offline_many`` and the RPCs behind it.

Every session must get exactly what ``fetch_offline`` gives it (pubsub
positions, queue mode, time ranges, QoS 0, ``start="now"``, ``max_count``,
several filters in one call); the node must really share the work (one scan
of each shard per topic filter, counted by ``mqds_offline_fetch_scans_total``);
an answer stays within ``max_answer_bytes``, a session cut short says
``more`` and continues; bad input gets INVALID_ARGUMENT saying what was wrong;
and a broker's concurrent fetches go out together.
"""

from __future__ import annotations

import asyncio
import time
import tomllib
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mqds.broker.actions import BrokerHooks
from mqds.broker.hooks import HookConfig, parse_config
from mqds.client import Client, Message, OfflineFetch, aio
from mqds.protocol.limits import MAX_SESSIONS_PER_CALL
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import sessions_pb2_grpc as spb_grpc

pytestmark = pytest.mark.integration

N_SHARDS = 4
ANSWER_BYTES = 256 * 1024  # the nodes' max_answer_bytes: small, so the bound is reached with 20 large messages


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    base = tmp_path_factory.mktemp("shared-fetch") / "c"
    with LocalCluster(base, 3, n_shards=N_SHARDS, metrics=True, args=[f"--max-answer-bytes={ANSWER_BYTES}"]) as c:
        c.start()
        yield c


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster.addresses, timeout_s=30) as c:
        yield c


def publish(client: Client, topic: str, count: int, *, qos: int = 1, senders: int = 6, size: int = 0) -> list[Message]:
    """``count`` messages on ``topic`` from several senders (so every shard), oldest first."""
    pad = b"x" * size
    batch = [Message(topic, f"{topic}-{i}".encode() + pad, sender=f"pub-{i % senders}", qos=qos) for i in range(count)]
    return sorted(client.store_batch(batch), key=lambda m: (m.timestamp_us, m.shard))


def scans(cluster: LocalCluster) -> int:
    """``mqds_offline_fetch_scans_total`` summed over every node and shard."""
    total = 0.0
    for proc in cluster.nodes.values():
        assert proc.metrics_url is not None
        with urllib.request.urlopen(proc.metrics_url, timeout=5) as response:
            for family in text_string_to_metric_families(response.read().decode()):
                if family.name == "mqds_offline_fetch_scans":
                    total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return int(total)


def test_every_session_gets_what_fetch_offline_gives_it(client: Client) -> None:
    publish(client, "many/a/x", 6)
    # A pair whose position starts after those six, and (below) one that acknowledged some messages.
    client.start_read_position("starter", "many/a/#")
    stored = publish(client, "many/a/x", 20) + publish(client, "many/b/x", 8) + publish(client, "many/a/q", 3, qos=0)
    stored.sort(key=lambda m: (m.timestamp_us, m.shard))
    for m in [m for m in stored if m.topic == "many/a/x"][:7]:
        client.ack("acker", "many/a/#", m)
    queue = publish(client, "many/queue/jobs", 9)
    for m in queue[:4]:
        client.ack("worker-1", "many/queue/#", m, mode="queue")

    requests = [
        OfflineFetch("fresh", "many/a/#"),  # no position: the whole history
        OfflineFetch("acker", "many/a/#"),  # after its acknowledgements, on the same filter
        OfflineFetch("starter", "many/a/#"),  # from its start
        OfflineFetch("fresh", "many/a/#", max_count=5),  # the same pair, cut at 5
        OfflineFetch("acker", "many/a/#", include_qos0=True),
        OfflineFetch("worker-2", "many/queue/#", mode="queue"),
        OfflineFetch("worker-2", "many/queue/#", mode="queue", max_count=2),
        OfflineFetch("fresh", "many/#"),
        OfflineFetch("nobody", "nothing/here/#"),
        OfflineFetch("starter", "many/a/#", start="now"),  # has a position: reads on from it
    ]
    got = client.fetch_offline_many(requests)
    assert got == [one_by_one(client, r) for r in requests]
    assert [len(g) for g in got[:1] + got[2:4] + got[5:7] + got[8:]] == [26, 20, 5, 5, 2, 0, 20]
    assert len(got[4]) == len(got[1]) + 3 and all(got[:8])  # the QoS 0 ones too
    # (clientid, filter) pairs with the call's own options.
    assert client.fetch_offline_many([("fresh", "many/b/#"), ("acker", "many/a/#")], max_count=3) == [
        client.fetch_offline("fresh", "many/b/#", max_count=3),
        client.fetch_offline("acker", "many/a/#", max_count=3),
    ]
    assert client.fetch_offline_many([]) == []

    # start="now" for pairs without a position: started by the call, so they read nothing of the past.
    assert client.fetch_offline_many([("new-1", "many/a/#"), ("new-2", "many/#")], start="now") == [[], []]
    position = client.read_position("new-1", "many/a/#")
    assert position.found and position.start_us > 0
    later = publish(client, "many/a/x", 3)
    assert client.fetch_offline_many([("new-1", "many/a/#"), ("new-2", "many/#")], start="now") == [later, later]


def test_a_time_range_cuts_the_same(client: Client) -> None:
    publish(client, "range/x", 4)
    time.sleep(3.0)
    middle = time.time()
    newer = publish(client, "range/x", 4)
    # From 1.5 s before `middle`: the newer four are in it, the older (3 s before) are not.
    request = OfflineFetch("ranged", "range/#", time_range_s=time.time() - middle + 1.5)
    assert client.fetch_offline_many([request, ("all", "range/#")]) == [
        newer,
        one_by_one(client, OfflineFetch("all", "range/#")),
    ]
    assert one_by_one(client, request) == newer


def one_by_one(client: Client, r: OfflineFetch) -> list[Message]:
    return client.fetch_offline(
        r.clientid, r.topic_filter, r.mode, r.max_count, r.time_range_s, include_qos0=r.include_qos0, start=r.start
    )


def test_the_asyncio_client_gives_the_same(cluster: LocalCluster, client: Client) -> None:
    publish(client, "aio-many/t", 12)

    async def scenario() -> list[list[Message]]:
        async with aio.Client(cluster.addresses, timeout_s=30) as c:
            return await c.fetch_offline_many(
                [OfflineFetch("a", "aio-many/#", max_count=4), ("b", "aio-many/t"), ("c", "aio-many/+")]
            )

    got = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert got == [
        client.fetch_offline("a", "aio-many/#", max_count=4),
        client.fetch_offline("b", "aio-many/t"),
        client.fetch_offline("c", "aio-many/+"),
    ]
    assert [len(g) for g in got] == [4, 12, 12]


def test_sessions_of_one_filter_share_one_scan_per_shard(cluster: LocalCluster, client: Client) -> None:
    stored = publish(client, "shared/s/x", 60, senders=1)  # one shard: an acknowledgement is an exact position
    # 40 sessions on one filter, at 40 different positions, and 5 on a second filter.
    sessions = [f"scan-{i}" for i in range(40)]
    for i, clientid in enumerate(sessions[1:], start=1):
        client.ack(clientid, "shared/#", stored[i - 1])
    requests = [(c, "shared/#") for c in sessions] + [(f"other-{i}", "shared/+/x") for i in range(5)]
    before = scans(cluster)
    got = client.fetch_offline_many(requests)
    assert scans(cluster) - before == 2 * N_SHARDS  # two filters: each shard scanned once for each
    assert all(got[i] == stored[i:] for i in range(40)), "every session its own messages"
    assert all(g == stored for g in got[40:])

    before = scans(cluster)
    one_by_one = [client.fetch_offline(c, f) for c, f in requests]
    assert scans(cluster) - before == len(requests) * N_SHARDS  # the old way: every session scans every shard
    assert one_by_one == got


def test_an_answer_stays_bounded_and_a_session_cut_short_continues(cluster: LocalCluster, client: Client) -> None:
    # 60 messages of 16 KiB on shard 0 alone: 960 KiB, nearly four answers' worth.
    sender = next(f"big-{i}" for i in range(100) if shard_of(f"big-{i}", N_SHARDS) == 0)
    batch = [Message("big/t", f"{i:03}".encode() + b"x" * 16384, sender=sender, qos=1) for i in range(60)]
    stored = client.store_batch(batch)
    client.ack("big-late", "big/#", stored[29])

    def fetch_from_the_leader(request: spb.FetchMessagesSharedRequest) -> spb.FetchMessagesSharedResponse:
        """The raw call to shard 0's leader; again on the new one if leadership moved meanwhile."""
        deadline = time.monotonic() + 30
        while True:
            leader = cluster.leader(0)
            try:
                if leader is not None:
                    with grpc.insecure_channel(cluster.nodes[leader].address) as channel:
                        answer: spb.FetchMessagesSharedResponse = spb_grpc.SessionsStub(channel).FetchMessagesShared(
                            request, timeout=30
                        )
                        return answer
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
            time.sleep(0.2)

    sessions = [
        spb.SharedFetchSession(topic_filter="big/#", max_count=500),
        spb.SharedFetchSession(topic_filter="big/#", max_count=500, after_us={0: stored[29].timestamp_us}),
        spb.SharedFetchSession(topic_filter="big/+", max_count=10),
    ]
    got: list[list[bytes]] = [[] for _ in sessions]
    answers = 0
    pending = list(range(len(sessions)))
    while pending:
        request = spb.FetchMessagesSharedRequest(shards=[0], sessions=[sessions[i] for i in pending])
        raw = fetch_from_the_leader(request)
        assert raw.ByteSize() <= ANSWER_BYTES + 17_000, raw.ByteSize()  # one message over it at most
        answers += 1
        still = []
        for i, result in zip(pending, raw.sessions, strict=True):
            mine = [raw.messages[k] for k in result.indexes]
            assert [m.timestamp_us for m in mine] == sorted(m.timestamp_us for m in mine)
            got[i] += [m.payload[:3] for m in mine]
            if result.more:  # as sessions.proto says: after its last message, for what is left
                if mine:
                    sessions[i].after_us[0] = mine[-1].timestamp_us
                sessions[i].max_count -= len(mine)
                still.append(i)
        pending = still
        assert answers < 20
    assert answers >= 4
    names = [f"{i:03}".encode() for i in range(60)]
    assert got == [names, names[30:], names[:10]]
    # The client does the same by itself.
    many = client.fetch_offline_many([("big-early", "big/#"), ("big-late", "big/#"), ("x", "big/+")], max_count=500)
    assert [[m.payload[:3] for m in g] for g in many] == [names, names[30:], names]
    assert many[0] == stored


def test_bad_input_is_invalid_argument_with_what_was_wrong(cluster: LocalCluster, client: Client) -> None:
    stub = spb_grpc.SessionsStub(grpc.insecure_channel(cluster.addresses[0]))
    too_many = MAX_SESSIONS_PER_CALL + 1
    session = spb.SharedFetchSession(topic_filter="a/#", max_count=5)
    pair = spb.ReadPositionPair(clientid="c", topic_filter="a/#")
    cases = [
        (stub.FetchMessagesShared, spb.FetchMessagesSharedRequest(), "sessions is empty"),
        (
            stub.FetchMessagesShared,
            spb.FetchMessagesSharedRequest(sessions=[session] * too_many),
            "FetchMessagesSharedRequest.sessions holds 1,001 entries; at most 1,000",
        ),
        (
            stub.FetchMessagesShared,
            spb.FetchMessagesSharedRequest(
                sessions=[session, spb.SharedFetchSession(topic_filter="a/#/b", max_count=1)]
            ),
            "sessions[1]: ",
        ),
        (
            stub.FetchMessagesShared,
            spb.FetchMessagesSharedRequest(sessions=[spb.SharedFetchSession(topic_filter="a/#")]),
            "sessions[0]: max_count must be at least 1",
        ),
        (
            stub.FetchMessagesShared,
            spb.FetchMessagesSharedRequest(
                shards=[0], sessions=[spb.SharedFetchSession(topic_filter="a", max_count=1, shards=[1])]
            ),
            "sessions[0].shards names shard 1",
        ),
        (stub.GetReadPositions, spb.ReadPositionsRequest(), "pairs is empty"),
        (
            stub.StartReadPositions,
            spb.ReadPositionsRequest(pairs=[pair] * too_many),
            "ReadPositionsRequest.pairs holds 1,001 entries; at most 1,000",
        ),
        (
            stub.GetReadPositions,
            spb.ReadPositionsRequest(pairs=[pair, spb.ReadPositionPair(clientid="", topic_filter="a")]),
            "pairs[1]: clientid is empty",
        ),
        (
            stub.StartReadPositions,
            spb.ReadPositionsRequest(pairs=[spb.ReadPositionPair(clientid="a\x00b", topic_filter="a")]),
            "pairs[0]: clientid 'a\\x00b' contains NUL",
        ),
        (
            stub.GetReadPositions,
            spb.ReadPositionsRequest(pairs=[spb.ReadPositionPair(clientid="c", topic_filter="+x")]),
            "pairs[0]: ",
        ),
    ]
    for method, request, detail in cases:
        with pytest.raises(grpc.RpcError) as failed:
            method(request, timeout=10)
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (detail, failed.value.details())
        assert detail in (failed.value.details() or ""), failed.value.details()
    # The client checks its arguments before any call.
    with pytest.raises(ValueError, match="clientid is empty"):
        client.fetch_offline_many([("", "a/#")])
    with pytest.raises(ValueError, match="mode must be 'pubsub' or 'queue'"):
        client.fetch_offline_many([OfflineFetch("c", "a/#", mode="fanout")])
    with pytest.raises(ValueError, match="max_count must be 1 or more"):
        client.fetch_offline_many([("c", "a/#")], max_count=0)


def test_a_brokers_concurrent_reconnects_share_their_fetches(cluster: LocalCluster, client: Client) -> None:
    config = load_config_text(
        """
        [[rule]]
        hook = "session.subscribed"
        topic = "storm/#"
        action = "on_message_fetch"
        offline_opts = { max_returned_count = 25 }
        """
    )
    sessions = [f"storm-{i}" for i in range(30)]

    async def scenario() -> tuple[list[list[Message]], list[bool], BrokerHooks]:
        async with aio.Client(cluster.addresses, timeout_s=30) as c:
            hooks = BrokerHooks(c, config, node="broker-1")
            # Each subscribes (its read position starts), then some messages are published for it.
            for i, clientid in enumerate(sessions):
                assert await hooks.begin_subscription(clientid, f"storm/{i % 3}/#")
            await c.store_batch(
                [Message(f"storm/{i % 3}/t", f"m{i}".encode(), sender=f"s{i % 5}", qos=1) for i in range(60)]
            )
            deliveries = await asyncio.gather(
                *(hooks.session_subscribed(clientid, f"storm/{i % 3}/#", 1) for i, clientid in enumerate(sessions))
            )
            return [d.offline for d in deliveries], [d.more for d in deliveries], hooks

    offline, more, hooks = asyncio.run(asyncio.wait_for(scenario(), 60))
    for i, clientid in enumerate(sessions):
        assert offline[i] == client.fetch_offline(clientid, f"storm/{i % 3}/#", max_count=25), clientid
        assert len(offline[i]) == 20 and not more[i]
    assert hooks.offline.fetches == len(sessions)
    assert hooks.offline.calls < len(sessions) / 4, hooks.offline.calls
    assert hooks.stats["fetched_offline"] == 20 * len(sessions)


def load_config_text(text: str) -> HookConfig:
    return parse_config(tomllib.loads(text), "<test rules>")

"""Push subscriptions (Client.follow, Storage.Follow) against a real 3-node cluster: exactly once, in order, bounded."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mqds.client import Client, FollowPosition, Message, Subscription, aio
from mqds.client import errors as E
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster
from mqds.v1 import storage_pb2 as pb

pytestmark = pytest.mark.integration

N_SHARDS = 4
FEED_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    args = ["--follow-feed-bytes", str(FEED_BYTES), "--leader-balance-interval-s", "1"]
    with LocalCluster(tmp_path_factory.mktemp("follow") / "c", 3, n_shards=N_SHARDS, args=args, metrics=True) as c:
        c.start()
        c.wait_leaders_settled()
        yield c


def senders(prefix: str, count: int = 8) -> list[str]:
    return [f"{prefix}-{i}" for i in range(count)]


def take(sub: Subscription, count: int, timeout_s: float = 60) -> list[Message]:
    """Poll ``sub`` until ``count`` messages came (failing the test after ``timeout_s``)."""
    got: list[Message] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count:
        assert time.monotonic() < deadline, f"only {len(got)} of {count} messages came"
        batch = sub.poll(1.0)
        if batch is not None:
            assert all(m.shard == batch.shard for m in batch.messages)
            got.extend(batch.messages)
    return got


def check_once_in_order(got: list[Message], expected: int) -> None:
    numbers = [int(m.payload) for m in got]
    assert sorted(numbers) == list(range(expected)), "each message exactly once"
    by_sender: dict[str, list[int]] = {}
    for m in got:
        by_sender.setdefault(m.sender, []).append(int(m.payload))
    assert all(seq == sorted(seq) for seq in by_sender.values()), "each sender's messages in the order stored"


def follow_sent(cluster: LocalCluster, source: str) -> float:
    """mqds_follow_sent_messages_total{source} summed over the nodes."""
    return metric_total(cluster, "mqds_follow_sent_messages_total", source=source)


def metric_total(cluster: LocalCluster, name: str, **labels: str) -> float:
    """The samples of ``name`` with ``labels`` summed over the live nodes."""
    total = 0.0
    for node_id in cluster.live():
        url = cluster.nodes[node_id].metrics_url
        assert url is not None
        with urllib.request.urlopen(url, timeout=5) as response:
            for family in text_string_to_metric_families(response.read().decode()):
                for sample in family.samples:
                    if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                        total += sample.value
    return total


def test_every_message_once_in_order_across_a_leader_kill_a_rotation_and_a_new_stream(cluster: LocalCluster) -> None:
    names = senders("k")
    total = 1200
    with Client(cluster.addresses, timeout_s=30) as client:
        client.store_batch([Message(f"k/{i % 3}", str(i).encode(), names[i % 8], qos=1) for i in range(200)])
        sub = client.follow("k/#", window=100)
        written = threading.Event()

        def write() -> None:
            with cluster.admin_client(timeout_s=60) as writer:
                for start in range(200, total, 50):
                    # Half-way a topic structure the filter matches appears (a new stream).
                    topic = "k/new/{}" if start >= 700 else "k/{}"
                    chunk = range(start, start + 50)
                    writer.store_batch([Message(topic.format(i % 3), str(i).encode(), names[i % 8], 1) for i in chunk])
                    if start == 500:
                        writer.add_generation()
            written.set()

        writer = threading.Thread(target=write)
        writer.start()
        got = take(sub, 300)
        victim = cluster.wait_for_leader(shard_of(names[0], N_SHARDS))
        cluster.kill(victim)
        try:
            got += take(sub, 500)
        finally:
            cluster.start_node(victim)
        writer.join(timeout=120)
        assert written.is_set()
        got += take(sub, total - len(got))
        assert sub.restarts >= 1
        assert sub.poll(0.5) is None  # and nothing more
        sub.close()
    check_once_in_order(got, total)


def test_a_saved_position_continues_after_what_was_received(cluster: LocalCluster) -> None:
    names = senders("r", 4)
    with Client(cluster.addresses, timeout_s=30) as client:
        client.store_batch([Message("r/a", str(i).encode(), names[i % 4], qos=1) for i in range(100)])
        with client.follow("r/#") as sub:
            got = take(sub, 100)
            saved = sub.position.to_bytes()
        client.store_batch([Message("r/a", str(i).encode(), names[i % 4], qos=1) for i in range(100, 160)])
        with client.follow("r/#", position=saved) as again:
            got += take(again, 60)
            assert again.poll(0.5) is None
        with client.follow("r/#", start_time_us=got[120].timestamp_us or 0, shards=[got[120].shard]) as later:
            assert take(later, 1)[0].timestamp_us == got[120].timestamp_us
    check_once_in_order(got, 160)


def test_a_slow_subscriber_costs_the_node_no_memory_and_catches_up(cluster: LocalCluster) -> None:
    names = senders("slow", 4)
    from_disk = follow_sent(cluster, "disk")
    with Client(cluster.addresses, timeout_s=30) as client:
        sub = client.follow("slow/#", window=10)
        assert sub.poll(0.2) is None  # nothing yet: its parts are started
        payload = b"x" * 200
        total = 2000  # 2,000 x ~230 bytes: several times the feed of each shard
        for start in range(0, total, 200):
            client.store_batch(
                [Message("slow/t", payload + str(i).encode(), names[i % 4], 1) for i in range(start, start + 200)]
            )
        got = [Message(m.topic, m.payload[200:], m.sender) for m in take(sub, total)]
        sub.close()
    check_once_in_order(got, total)
    for node_id in cluster.live():  # what the nodes kept for it stayed within the feed's bound
        url = cluster.nodes[node_id].metrics_url
        assert url is not None
        with urllib.request.urlopen(url, timeout=5) as response:
            for family in text_string_to_metric_families(response.read().decode()):
                if family.name == "mqds_follow_feed_bytes":
                    assert all(s.value <= FEED_BYTES + 64 * 1024 for s in family.samples)
    assert follow_sent(cluster, "disk") - from_disk >= total / 2  # fell behind the feed: read from disk


def test_many_subscribers_of_one_filter_each_get_everything_from_the_shared_feed(cluster: LocalCluster) -> None:
    names = senders("fan")
    with Client(cluster.addresses, timeout_s=30) as client:
        subs = [client.follow("fan/#", start_time_us=int(time.time() * 1e6), any_replica=i % 2 == 1) for i in range(20)]
        # One message from each sender, awaited by every subscriber: the part of each of their shards is
        # then at the head, so what follows comes from the feed (a fixed sleep was too short on a busy machine).
        client.store_batch([Message("fan/w", b"warm-up", name, 1) for name in names])
        for sub in subs:
            assert sorted(m.sender for m in take(sub, len(names))) == sorted(names)
        from_feed = follow_sent(cluster, "feed")
        for start in range(0, 400, 100):
            client.store_batch([Message("fan/t", str(i).encode(), names[i % 8], 1) for i in range(start, start + 100)])
        for sub in subs:
            check_once_in_order(take(sub, 400), 400)
            sub.close()
    assert follow_sent(cluster, "feed") - from_feed >= 20 * 400 * 0.9


def test_subscribers_catching_up_together_share_the_disk_reads(cluster: LocalCluster) -> None:
    """A backlog read by 20 subscribers from the start: each gets all of it, the nodes read it about once."""
    names = senders("convoy")
    backlog = 3000
    with Client(cluster.addresses, timeout_s=30) as client:
        for start in range(0, backlog, 500):
            client.store_batch(
                [Message("convoy/t", str(i).encode(), names[i % 8], 1) for i in range(start, start + 500)]
            )
        read_before = metric_total(cluster, "mqds_follow_disk_read_messages_total")
        sent_before = follow_sent(cluster, "disk")
        subs = [client.follow("convoy/#") for _ in range(20)]
        for sub in subs:
            check_once_in_order(take(sub, backlog), backlog)
            sub.close()
    sent = follow_sent(cluster, "disk") - sent_before
    read = metric_total(cluster, "mqds_follow_disk_read_messages_total") - read_before
    assert sent >= 20 * backlog * 0.9  # behind the feed from the start: read from disk
    assert read <= 3 * backlog, f"{read:,.0f} messages read from disk to send {sent:,.0f}: not shared"


def raw_follow(cluster: LocalCluster, requests: list[pb.FollowRequest], answers: int) -> list[pb.FollowResponse]:
    """Send ``requests`` on a Follow call to the first node; the first ``answers`` answers (the call's error raised)."""
    out: queue.SimpleQueue[pb.FollowRequest | None] = queue.SimpleQueue()
    for request in requests:
        out.put(request)

    def gen() -> Iterator[pb.FollowRequest]:
        while (request := out.get()) is not None:
            yield request

    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        method = channel.stream_stream(
            "/mqds.v1.Storage/Follow",
            request_serializer=pb.FollowRequest.SerializeToString,
            response_deserializer=pb.FollowResponse.FromString,
        )
        call = method(gen(), timeout=20)
        got = []
        try:
            for answer in call:
                got.append(answer)
                if len(got) == answers:
                    break
        finally:
            out.put(None)
            call.cancel()
        return got


def start(id_: int, topic_filter: str = "bad/#", credit: int = 5, **fields: int) -> pb.FollowRequest:
    return pb.FollowRequest(
        start=pb.FollowStart(id=id_, topic_filter=topic_filter, shard=0, credit=credit, stale_ok=True, **fields)
    )


def test_bad_input_gets_a_clear_status_and_the_node_goes_on_serving(cluster: LocalCluster) -> None:
    with cluster.admin_client(timeout_s=30) as client:
        with pytest.raises(E.InvalidArgumentError, match="'#' must be the last level"):
            client.follow("a/#/b")
        with client.follow("bad/#") as sub:
            saved = sub.position.to_bytes()
        with pytest.raises(E.InvalidArgumentError, match="checksum"):
            client.follow("bad/#", position=saved[:-1] + bytes([saved[-1] ^ 1]))
        with pytest.raises(E.InvalidArgumentError, match="topic filter 'bad/#', not 'other/#'"):
            client.follow("other/#", position=saved)
        with pytest.raises(E.InvalidArgumentError, match="window"):
            client.follow("bad/#", window=0)

        # On the wire: a failure answer for the subscription, the call goes on.
        far = int(time.time() * 1e6) + 2 * 86_400_000_000
        answers = raw_follow(cluster, [start(1, "a/#/b"), start(2, after_us=far)], 2)
        assert [(a.id, a.failure.reason) for a in answers] == [(1, "INVALID_TOPIC_FILTER"), (2, "INVALID_REQUEST")]
        # A start naming more subscriptions (``also``) fails for each of them.
        many = start(1, "a/#/b")
        many.start.also.extend([7, 8])
        answers = raw_follow(cluster, [many, start(2, after_us=far)], 4)
        assert sorted((a.id, a.failure.reason) for a in answers) == [
            (1, "INVALID_TOPIC_FILTER"),
            (2, "INVALID_REQUEST"),
            (7, "INVALID_TOPIC_FILTER"),
            (8, "INVALID_TOPIC_FILTER"),
        ]
        twice, taken, too_many = start(1), start(2), start(1)
        twice.start.also.extend([3, 3])
        taken.start.also.extend([3, 1])
        too_many.start.also.extend(range(2, 10_002))
        # Protocol errors end the call with INVALID_ARGUMENT and say why.
        for requests, why in (
            ([start(1, credit=0)], "credit 0"),
            ([start(1), start(1)], "already in use"),
            ([twice], "names an id twice"),
            ([start(1), taken], "subscription id 1 is already in use"),
            ([too_many], "this start adds 10,001 (follow_max_subscriptions is 10,000)"),
            ([start(1), pb.FollowRequest(credit=pb.FollowCredit(id=1, messages=0))], "at least 1"),
            ([pb.FollowRequest()], "start, credit or cancel"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                raw_follow(cluster, requests, 10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in (err.value.details() or "")

        # A position whose messages retention dropped.
        sender = next(f"d-{i}" for i in range(1000) if shard_of(f"d-{i}", N_SHARDS) == 1)
        stored = client.store_batch([Message("drop/a", b"1", sender, 1)])
        with client.follow("drop/#", shards=[1]) as sub:
            assert [m.payload for m in take(sub, 1)] == [b"1"]
            before = FollowPosition.of(sub.cluster_id, "drop/#", {1: (stored[0].timestamp_us or 0) - 1})
        (old,) = [g for g in client.list_generations(1) if g.current]
        client.add_generation(1)
        client.drop_generation(1, old.generation)
        with client.follow("drop/#", position=before) as sub, pytest.raises(E.GenerationDroppedError, match="dropped"):
            sub.poll(10)

        # And the nodes still serve.
        client.store_batch([Message("bad/ok", b"ok", sender, 1)])
        with client.follow("bad/#") as sub:
            assert [m.payload for m in take(sub, 1)] == [b"ok"]


def test_the_asyncio_client_follows_too(cluster: LocalCluster) -> None:
    names = senders("aio", 4)

    async def run() -> tuple[list[Message], bytes]:
        async with aio.Client(cluster.addresses, timeout_s=30) as client:
            await client.store_batch([Message("aio/t", str(i).encode(), names[i % 4], 1) for i in range(50)])
            got: list[Message] = []
            async with await client.follow("aio/#", window=20) as sub:
                async for batch in sub:
                    got.extend(batch.messages)
                    if len(got) == 50:
                        await client.store_batch(
                            [Message("aio/t", str(i).encode(), names[i % 4], 1) for i in range(50, 80)]
                        )
                    if len(got) >= 80:
                        break
                assert await sub.poll(0.3) is None
                return got, sub.position.to_bytes()

    got, saved = asyncio.run(run())
    check_once_in_order(got, 80)
    with Client(cluster.addresses, timeout_s=30) as client:  # a position saved by one client works in the other
        client.store_batch([Message("aio/t", b"80", names[0], 1)])
        with client.follow("aio/#", position=saved) as sub:
            assert [m.payload for m in take(sub, 1)] == [b"80"]


def test_a_subscriber_at_the_head_goes_on_while_retention_drops_what_it_has_read(cluster: LocalCluster) -> None:
    """Retention drops every closed generation of every shard under a live subscription: nothing lost or repeated."""
    names = senders("ret")
    with Client(cluster.addresses, timeout_s=30) as client, cluster.admin_client() as admin:
        sub = client.follow("ret/#", window=100)
        client.store_batch([Message(f"ret/{i % 3}", str(i).encode(), names[i % 8], 1) for i in range(100)])
        got = take(sub, 100)
        admin.add_generation()
        dropped = 0
        for generation in admin.list_generations():
            if not generation.current:
                admin.drop_generation(generation.shard, generation.generation)
                dropped += 1
        assert dropped >= N_SHARDS  # every shard's generation that held the first 100
        client.store_batch([Message(f"ret/{i % 3}", str(i).encode(), names[i % 8], 1) for i in range(100, 200)])
        got += take(sub, 100)
        assert sub.poll(0.5) is None  # and nothing more
        sub.close()
    check_once_in_order(got, 200)

"""Pipelined writes (store_async / publish) against a real 3-node cluster: window, order, exactly once, failover."""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Iterator
from concurrent import futures

import pytest
from harness import replayed, sender_on

from mqds.client import Client, Message, aio
from mqds.client import errors as E
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster

pytestmark = pytest.mark.integration

N_SHARDS = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    args = ["--leader-balance-interval-s", "1"]
    with LocalCluster(tmp_path_factory.mktemp("pipelined") / "c", 3, n_shards=N_SHARDS, args=args) as c:
        c.start()
        c.wait_leaders_settled()
        yield c


def test_many_single_message_calls_through_a_small_window_are_stored_once_in_call_order(
    cluster: LocalCluster,
) -> None:
    senders = [f"pipe-{n}" for n in range(8)]
    with Client(cluster.addresses, timeout_s=30, max_in_flight_messages=64) as client:
        pending = [
            client.store_async(Message(f"pipe/a/{i % 8}", str(i).encode(), senders[i % 8], qos=1)) for i in range(2000)
        ]
        results = [f.result(timeout=60) for f in pending]
    assert [r[0].payload for r in results] == [str(i).encode() for i in range(2000)]
    assert all(r[0].shard == shard_of(r[0].sender, N_SHARDS) and r[0].timestamp_us for r in results)
    for sender in senders:  # positions increase in call order, per sender
        stamps = [r[0].timestamp_us or 0 for r in results if r[0].sender == sender]
        assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)

    stored = replayed(cluster, "pipe/a/#")
    counts = collections.Counter(m.payload for m in stored)
    assert len(stored) == 2000 and set(counts.values()) == {1}
    for sender in senders:
        order = [int(m.payload) for m in stored if m.sender == sender]
        assert order == sorted(order)


def test_the_futures_of_one_sender_complete_in_call_order(cluster: LocalCluster) -> None:
    completed: list[int] = []
    lock = threading.Lock()

    def record(n: int) -> None:
        with lock:
            completed.append(n)

    with Client(cluster.addresses, timeout_s=30, max_in_flight_messages=200) as client:
        pending = []
        for n in range(600):
            future = client.store_async([Message("pipe/order", str(n).encode(), "pipe-order", qos=1)])
            future.add_done_callback(lambda _f, n=n: record(n))
            pending.append(future)
        futures.wait(pending, timeout=60)
    assert all(f.exception() is None for f in pending)
    assert completed == list(range(600))


def test_the_asyncio_client_publishes_from_many_tasks(cluster: LocalCluster) -> None:
    async def scenario() -> list[list[Message]]:
        async with aio.Client(cluster.addresses, timeout_s=30, max_in_flight_messages=100) as client:

            async def task(t: int) -> list[Message]:
                out = []
                for i in range(10):
                    msg = Message(f"pipe/aio/{t}", f"{t}:{i}".encode(), f"pipe-aio-{t}", qos=1)
                    out += await client.publish(msg)
                return out

            return await asyncio.gather(*(task(t) for t in range(100)))

    results = asyncio.run(asyncio.wait_for(scenario(), 90))
    for t, stored in enumerate(results):
        assert [m.payload for m in stored] == [f"{t}:{i}".encode() for i in range(10)]
        stamps = [m.timestamp_us or 0 for m in stored]
        assert stamps == sorted(stamps) and all(stamps)
    stored = replayed(cluster, "pipe/aio/#")
    assert sorted(m.payload for m in stored) == sorted(f"{t}:{i}".encode() for t in range(100) for i in range(10))


def test_an_invalid_topic_fails_only_its_own_call(cluster: LocalCluster) -> None:
    with Client(cluster.addresses, timeout_s=30) as client:
        before = client.store_async(Message("pipe/inv", b"before", "pipe-inv", qos=1))
        bad = client.store_async(Message("pipe/+/inv", b"bad", "pipe-inv", qos=1))
        after = client.store_async([Message("pipe/inv", b"after", "pipe-inv", qos=1)])
        assert before.result(timeout=30)[0].payload == b"before"
        assert after.result(timeout=30)[0].payload == b"after"
        with pytest.raises(E.InvalidArgumentError):
            bad.result(timeout=30)
        assert client.publish(Message("pipe/inv", b"again", "pipe-inv"))[0].timestamp_us
    assert [m.payload for m in replayed(cluster, "pipe/inv")] == [b"before", b"after", b"again"]


@pytest.mark.slow
def test_every_acknowledged_message_is_stored_once_across_a_leader_kill(cluster: LocalCluster) -> None:
    # Last in the module: it kills a node (and starts it again).
    shard = 2
    sender = sender_on(shard, "pipe-fo", N_SHARDS)
    victim = cluster.wait_for_leader(shard)
    total, kill_after = 3000, 600
    acked = threading.Semaphore(0)

    try:
        with Client(cluster.addresses, timeout_s=40, max_in_flight_messages=500) as client:
            pending: list[futures.Future[list[Message]]] = []

            def publish() -> None:
                for i in range(total):
                    future = client.store_async(Message("pipe/fo", str(i).encode(), sender, qos=1))
                    future.add_done_callback(lambda _f: acked.release())
                    pending.append(future)

            publisher = threading.Thread(target=publish)
            publisher.start()
            for _ in range(kill_after):
                assert acked.acquire(timeout=60)
            cluster.kill(victim)
            publisher.join(timeout=120)
            assert not publisher.is_alive()
            done, _ = futures.wait(pending, timeout=120)
            assert len(done) == total
            results = [f.result() for f in pending]  # none lost: every call was acknowledged
        assert cluster.leader(shard) != victim
        stamps = [r[0].timestamp_us or 0 for r in results]
        assert stamps == sorted(stamps), "acknowledged out of call order"

        stored = replayed(cluster, "pipe/fo")
        counts = collections.Counter(m.payload for m in stored)
        assert set(counts) == {str(i).encode() for i in range(total)}
        assert max(counts.values()) == 1, "a message was stored twice"
        assert [int(m.payload) for m in stored] == list(range(total))
    finally:
        cluster.start_node(victim)


def test_flush_waits_for_every_call_before_it_and_says_when_they_outlast_it(cluster: LocalCluster) -> None:
    sender = sender_on(1, "flush", N_SHARDS)
    with Client(cluster.addresses, timeout_s=30) as client:
        client.flush()  # nothing in flight: returns at once
        pending = [client.store_async(Message("flush/a", str(i).encode(), sender, qos=1)) for i in range(300)]
        client.flush()
        assert all(f.done() and not f.exception() for f in pending)
        # Calls that cannot commit: the shard's leader cut off from both followers.
        leader = cluster.wait_for_leader(1)
        cluster.partition([leader], [n for n in cluster.nodes if n != leader])
        try:
            stuck = [client.store_async(Message("flush/b", str(i).encode(), sender, qos=1)) for i in range(20)]
            with pytest.raises(E.DeadlineExceededError, match="20 of 20 pipelined calls still in flight"):
                client.flush(timeout_s=0.5)
            assert not any(f.done() for f in stuck)
        finally:
            cluster.heal()
        client.flush(timeout_s=60)  # they go on after a flush gave up, and complete once healed
        assert all(f.done() for f in stuck)
        assert all(not f.exception() for f in stuck)
    assert sorted(int(m.payload) for m in replayed(cluster, "flush/a")) == list(range(300))
    assert sorted(int(m.payload) for m in replayed(cluster, "flush/b")) == list(range(20))


def test_the_asyncio_client_flushes_too(cluster: LocalCluster) -> None:
    async def run() -> list[asyncio.Future[list[Message]]]:
        async with aio.Client(cluster.addresses, timeout_s=30) as client:
            await client.flush()
            pending = [
                await client.store_async(Message("aflush/a", str(i).encode(), f"aflush-{i % 5}", qos=1))
                for i in range(200)
            ]
            await client.flush()
            assert all(f.done() for f in pending)
            return pending

    pending = asyncio.run(run())
    assert all(not f.exception() for f in pending)
    assert len(replayed(cluster, "aflush/a")) == 200

"""The asyncio client against a real 3-node cluster: the same answers as the synchronous client, and failover.

Its admin calls too, as the synchronous client's are tested (test_backup.py, test_retention_rules.py,
test_share_groups.py): a backup restored into an empty cluster, retention rules set and read, the offline
messages of some shards and a share group's members.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from harness import sender_on

from mqds.client import BackupError, BackupReport, Client, ConnectionSettings, Message, RestoreReport, aio
from mqds.client import errors as E
from mqds.client.core.backup_files import Place, verify
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster

pytestmark = pytest.mark.integration

T = TypeVar("T")
N_SHARDS = 4


def run(coro: Coroutine[Any, Any, T], timeout_s: float = 60) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    args = ["--leader-balance-interval-s", "1"]
    with LocalCluster(tmp_path_factory.mktemp("aio") / "c", 3, n_shards=N_SHARDS, args=args) as c:
        c.start()
        # Leadership moves to each vnode's preferred replica (spread over the
        # nodes) soon after start; let it settle so the tests see stable leaders.
        c.wait_leaders_settled()
        yield c


def test_store_and_replay_match_the_sync_client(cluster: LocalCluster) -> None:
    batch = [
        Message(topic=f"aio/sensor/{n}/temp", payload=f"{n}:{r}".encode(), sender=f"dev-{n % 5}", qos=1)
        for r in range(4)
        for n in range(25)
    ]
    batch.append(Message(topic="aio/status", payload=b"on", sender="dev-1", retain=True, properties=[("k", "v")]))

    async def scenario() -> dict[str, Any]:
        async with aio.Client(cluster.addresses, timeout_s=20) as client:
            stored = await client.store_batch(batch)
            out: dict[str, Any] = {"stored": stored, "map": await client.cluster_map()}
            for topic_filter in ("aio/#", "aio/sensor/+/temp", "aio/sensor/7/#", "aio/status", "nothing/here"):
                out[topic_filter] = [m async for m in client.replay(topic_filter, batch_size=17)]
            streams = await client.get_streams("aio/sensor/3/temp")
            out["streams"] = streams
            _, stream = streams[0]
            it = await client.make_iterator(stream, "aio/sensor/3/temp")
            first = await client.next(it, batch_size=2)
            rest = await client.next(first.iterator, batch_size=100)
            out["iterated"] = first.messages + rest.messages
            return out

    got = run(scenario())
    stored = got["stored"]
    assert [m.payload for m in stored] == [m.payload for m in batch]
    assert all(m.timestamp_us and m.shard == shard_of(m.sender, N_SHARDS) for m in stored)
    assert got["map"].n_shards == N_SHARDS and len(got["map"].nodes) == 3

    with cluster.client(timeout_s=20) as sync:
        for topic_filter in ("aio/#", "aio/sensor/+/temp", "aio/sensor/7/#", "aio/status", "nothing/here"):
            expected = list(sync.replay(topic_filter))
            assert got[topic_filter] == expected, topic_filter
        assert got["streams"] == sync.get_streams("aio/sensor/3/temp")
    assert len(got["aio/#"]) == len(batch)
    assert [m.payload for m in got["aio/sensor/7/#"]] == [f"7:{r}".encode() for r in range(4)]
    assert got["aio/status"][0].retain and got["aio/status"][0].properties == (("k", "v"),)
    assert got["nothing/here"] == []
    assert [m.payload for m in got["iterated"]] == [f"3:{r}".encode() for r in range(4)]
    # Per sender, replay keeps the stored order.
    by_sender = collections.defaultdict(list)
    for m in got["aio/#"]:
        by_sender[m.sender].append(m.payload)
    for sender, payloads in by_sender.items():
        assert payloads == [m.payload for m in batch if m.sender == sender]


def test_generations_and_typed_errors(cluster: LocalCluster) -> None:
    async def scenario() -> None:
        # Generations are admin calls: the client presents the cluster secret.
        settings = ConnectionSettings(timeout_s=20, cluster_secret=cluster.secret)
        async with aio.Client(cluster.addresses, settings=settings) as client:
            stored = await client.store_batch([Message(topic="aio/g/1", payload=b"old", sender="gen-s")])
            shard = stored[0].shard
            assert shard is not None
            before = await client.list_generations(shard)
            new = await client.add_generation(shard)
            assert [g.generation for g in new] == [before[-1].generation + 1] and new[0].current
            everywhere = await client.list_generations()
            assert {g.shard for g in everywhere} == set(range(N_SHARDS))
            with pytest.raises(E.FailedPreconditionError) as cur:
                await client.drop_generation(shard, new[0].generation)
            assert cur.value.reason is E.Reason.CURRENT_GENERATION
            dropped = await client.drop_generation(shard, before[-1].generation)
            assert dropped.generation == before[-1].generation and not dropped.current
            with pytest.raises(E.InvalidArgumentError) as bad:
                await client.get_streams("a/#/b")
            assert bad.value.reason is E.Reason.INVALID_TOPIC_FILTER and not bad.value.retriable
            with pytest.raises(E.InvalidArgumentError) as topic:
                await client.store_batch([Message(topic="a/+/b")])
            assert topic.value.reason is E.Reason.INVALID_TOPIC
            assert topic.value.metadata["sequence"]  # the call's sequence, for a safe retry
            with pytest.raises(E.NotFoundError):
                await client.list_generations(99)
            with pytest.raises(ValueError, match="sequence"):
                await client.store_batch([Message(topic="t")], sequence=0)

    run(scenario())


def test_concurrent_store_batch_from_many_tasks_shares_one_map_refresh(cluster: LocalCluster) -> None:
    n_tasks, n_batches, per_batch = 40, 4, 10

    async def scenario() -> tuple[int, dict[str, list[int]], list[Message]]:
        async with aio.Client(cluster.addresses, timeout_s=30) as client:
            fetches = 0
            fetch = client._router._fetch_map

            async def counting_fetch(address: str, timeout_s: float) -> Any:
                nonlocal fetches
                fetches += 1
                return await fetch(address, timeout_s)

            client._router._fetch_map = counting_fetch  # type: ignore[method-assign]

            async def publisher(task: int, batches: range) -> list[int]:
                acked = []
                for b in batches:
                    seqs = list(range(b * per_batch, (b + 1) * per_batch))
                    msgs = [Message(topic=f"conc/{task}", payload=str(s).encode(), sender=f"pub-{task}") for s in seqs]
                    await client.store_batch(msgs)
                    acked.extend(seqs)
                return acked

            # Every task's first call needs the map, all at once.
            first = await asyncio.gather(*(publisher(t, range(1)) for t in range(n_tasks)))
            fetched_for_the_burst = fetches
            rest = await asyncio.gather(*(publisher(t, range(1, n_batches)) for t in range(n_tasks)))
            replayed = [m async for m in client.replay("conc/#")]
            acked = {f"pub-{t}": first[t] + rest[t] for t in range(n_tasks)}
            return fetched_for_the_burst, acked, replayed

    started = time.monotonic()
    fetches, acked, replayed = run(scenario())
    elapsed = time.monotonic() - started
    # 40 tasks started at once needed the map: one refresh (asking each of the 3 nodes) served them all.
    assert fetches <= 3, fetches
    seen: dict[str, list[int]] = collections.defaultdict(list)
    for m in replayed:
        seen[m.sender].append(int(m.payload))
    assert seen == acked  # every acknowledged message once, in publish order per publisher
    assert elapsed < 30, elapsed


def test_size_limits_give_a_clear_typed_error(cluster: LocalCluster) -> None:
    big = [Message(topic="size/a", payload=b"x" * 100_000, sender="size-s") for _ in range(3)]
    small_send = ConnectionSettings(timeout_s=20, max_send_message_bytes=200_000)

    async def send_too_much() -> E.MqdsError:
        async with aio.Client(cluster.addresses, settings=small_send) as client:
            with pytest.raises(E.InvalidArgumentError) as exc:
                await client.store_batch(big)
            return exc.value

    started = time.monotonic()
    err = run(send_too_much())
    assert time.monotonic() - started < 5, "a size limit is not retried"
    assert "max_send_message_bytes (200,000)" in err.message and not err.retriable
    with (
        pytest.raises(E.InvalidArgumentError, match="max_send_message_bytes"),
        Client(cluster.addresses, settings=small_send) as sync,
    ):
        sync.store_batch(big)

    # Responses: the node answers with more than the client accepts.
    with cluster.client(timeout_s=20) as writer:
        writer.store_batch(big)
    small_receive = ConnectionSettings(timeout_s=20, max_receive_message_bytes=150_000)

    async def read_too_much() -> E.MqdsError:
        async with aio.Client(cluster.addresses, settings=small_receive) as client:
            ((_, stream),) = await client.get_streams("size/a")
            it = await client.make_iterator(stream, "size/a")
            with pytest.raises(E.InvalidArgumentError) as exc:
                await client.next(it, batch_size=10)
            assert len((await client.next(it, batch_size=1)).messages) == 1  # a smaller batch fits
            return exc.value

    err = run(read_too_much())
    assert "max_receive_message_bytes (150,000)" in err.message and "batch_size" in err.message


def test_a_retry_after_a_lost_answer_stores_once_and_a_partial_failure_says_what_was_stored(
    cluster: LocalCluster,
) -> None:
    names = [sender_on(shard, f"eo{k}", N_SHARDS) for shard in range(N_SHARDS) for k in range(2)]

    def batch(first: int) -> list[Message]:
        return [Message(topic=f"eo/{n}", payload=str(i).encode(), sender=n) for n in names for i in (first, first + 1)]

    async def scenario() -> tuple[list[Message], E.PartialBatchError, set[int], list[Message], list[Message]]:
        async with aio.Client(cluster.addresses, timeout_s=20) as client:
            real = client._rpc
            lost: list[str] = []

            async def lose_first_answer(address: str, method: str, request: Any, timeout_s: float) -> Any:
                response = await real(address, method, request, timeout_s)
                if method == "StoreBatch" and not lost:
                    lost.append(address)
                    raise E.DeadlineExceededError(E.Reason.DEADLINE_EXCEEDED, "answer lost on the way back")
                return response

            client._rpc = lose_first_answer  # type: ignore[method-assign]
            stored = await client.store_batch(batch(0))
            assert lost, "the first answer was not lost: nothing was tested"

            # Every request to one node fails (as if it were cut off): its shards fail, the others are stored.
            await client.cluster_map()
            victim = client._router.table.leader_of(0)
            failed_shards: set[int] = set()

            async def unreachable(address: str, method: str, request: Any, timeout_s: float) -> Any:
                if method == "StoreBatch" and address == victim:
                    failed_shards.update(shard_of(m.sender, N_SHARDS) for m in request.messages)
                    raise E.UnavailableError(E.Reason.UNAVAILABLE, "injected: node unreachable")
                return await real(address, method, request, timeout_s)

            client._rpc = unreachable  # type: ignore[method-assign]
            leaders = {shard: client._router.table.leader_of(shard) for shard in range(N_SHARDS)}
            assert len(set(leaders.values())) > 1, f"one node leads every shard: {leaders}"
            with pytest.raises(E.PartialBatchError) as exc:
                await client.store_batch(batch(2), timeout_s=3)
            client._rpc = real  # type: ignore[method-assign]
            again = await client.store_batch(exc.value.failed_messages, sequence=exc.value.sequence)
            return stored, exc.value, failed_shards, again, [m async for m in client.replay("eo/#")]

    stored, err, failed_shards, again, replayed = run(scenario())
    assert len(stored) == 2 * len(names) and all(m.timestamp_us for m in stored)
    assert err.retriable and err.reason is E.Reason.UNAVAILABLE
    assert {m.shard for m in err.failed_messages} == failed_shards, (err, failed_shards)
    assert err.stored and all(m.timestamp_us and m.shard not in failed_shards for m in err.stored), err
    assert len(err.stored) + len(err.failed) == 2 * len(names) and len(again) == len(err.failed)
    # Each message exactly once, in order per sender.
    for name in names:
        assert [m.payload for m in replayed if m.sender == name] == [b"0", b"1", b"2", b"3"]
    assert len(replayed) == 4 * len(names)


def admin(cluster: LocalCluster) -> aio.Client:
    """An asyncio client presenting the cluster secret: it may make admin calls."""
    return aio.Client(cluster.addresses, settings=ConnectionSettings(timeout_s=30, cluster_secret=cluster.secret))


def test_backup_and_restore_from_asyncio_give_the_cluster_back_without_blocking_the_loop(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As test_backup.py with the sync client: what a backup holds comes back in an empty cluster of the same
    # shard count (messages, broker state, the retention policy); an incremental backup skips the closed
    # generations it holds; a cluster that is not empty is refused. Opening a file of the backup is made
    # slow here: the asyncio client does it in a worker thread, so the loop goes on meanwhile.
    place = str(tmp_path / "bk")
    senders = [sender_on(shard, "aiobk", N_SHARDS) for shard in range(N_SHARDS)]
    slow_s = 0.3
    opened = Place.open

    def slow_open(self: Place, relative: str, mode: str) -> Any:
        time.sleep(slow_s)
        return opened(self, relative, mode)

    async def longest_pause(work: Coroutine[Any, Any, T]) -> tuple[T, float]:
        """``work``'s result, and the longest the event loop was kept from a 10 ms ticker meanwhile."""
        longest = 0.0

        async def tick() -> None:
            nonlocal longest
            while True:
                before = time.monotonic()
                await asyncio.sleep(0.01)
                longest = max(longest, time.monotonic() - before - 0.01)

        ticker = asyncio.ensure_future(tick())
        try:
            return await work, longest
        finally:
            ticker.cancel()

    async def on_the_source() -> tuple[BackupReport, BackupReport, Any, float, list[Message], list[Message]]:
        async with admin(cluster) as c:
            await c.store_batch([Message(topic=f"aiobk/{s}", payload=b"old", sender=s, qos=1) for s in senders])
            await c.add_generation()
            await c.store_batch([Message(topic=f"aiobk/{s}", payload=b"new", sender=s, qos=1) for s in senders])
            await c.retain(Message(topic="aiobk/status", payload=b"up", sender=senders[0], qos=1))
            await c.subscribe("aiobk-client", "aiobk/#", qos=2)
            policy = await c.set_retention([("aiobk/#", 0)], default_s=0)
            shown: list[tuple[int, int, bool]] = []
            with monkeypatch.context() as patch:
                patch.setattr(Place, "open", slow_open)
                first, paused = await longest_pause(
                    c.backup(place, parallel=N_SHARDS, progress=lambda *p: shown.append(p))
                )
            assert {shard for shard, _, done in shown if done} == set(range(N_SHARDS))
            second = await c.backup(place)
            messages = [m async for m in c.replay("aiobk/#")]
            return first, second, policy, paused, messages, await c.retained("aiobk/#")

    first, second, policy, paused, messages, retained = run(on_the_source())
    assert paused < slow_s * 2 / 3, f"the event loop was blocked {paused:.2f} s"
    manifest = Place(place).read_manifest()
    assert verify(Place(place)).ok and manifest.run == second.run
    assert first.n_shards == N_SHARDS and sorted(first.fences) == list(range(N_SHARDS))
    assert first.files_written >= 2 * N_SHARDS and first.files_skipped == 0 and first.records > 0
    # The second run copies again only what changed: the closed generations are the first run's files.
    closed = [f for _, f in manifest.files() if f.generation is not None and f.generation.until_us]
    assert len(closed) >= N_SHARDS and second.files_skipped == len(closed)
    assert all(f.run == first.run for f in closed)
    with LocalCluster(tmp_path / "target", 1, n_shards=N_SHARDS, replication_factor=1) as target:
        target.start()

        async def on_the_target() -> tuple[RestoreReport, Any, list[Message], list[Message], dict[str, int], list[int]]:
            async with admin(target) as t:
                assert await t.retention() is None
                report = await t.restore(place, parallel=2)
                with pytest.raises(BackupError, match="the cluster is not empty, nothing was restored"):
                    await t.restore(place)
                return (
                    report,
                    await t.retention(),
                    [m async for m in t.replay("aiobk/#")],
                    await t.retained("aiobk/#"),
                    await t.subscriptions("aiobk-client"),
                    await t.abandon_restore(),
                )

        report, restored_policy, restored, restored_retained, subscriptions, abandoned = run(on_the_target())
    assert report.n_shards == N_SHARDS and report.retention_set and report.records > 0
    assert report.files == sum(1 for _ in manifest.files())
    assert restored_policy == policy
    assert [(m.shard, m.timestamp_us, m.topic, m.payload) for m in restored] == [
        (m.shard, m.timestamp_us, m.topic, m.payload) for m in messages
    ]
    assert [(m.topic, m.payload) for m in restored_retained] == [(m.topic, m.payload) for m in retained]
    assert subscriptions == {"aiobk/#": 2}
    assert abandoned == []  # the restore finished: nothing left to abandon


def test_retention_from_asyncio_is_set_read_and_checked_as_by_the_sync_client(cluster: LocalCluster) -> None:
    rules = [("aiort/short/#", 3600), ("aiort/#", 0)]

    async def scenario() -> tuple[Any, Any]:
        async with admin(cluster) as c:
            policy = await c.set_retention(rules, default_s=86_400)
            deadline = time.monotonic() + 30
            while (seen := await c.retention()) != policy and time.monotonic() < deadline:
                await asyncio.sleep(0.2)  # until the node that answers the map has applied it
            with pytest.raises(E.InvalidArgumentError, match="listed twice"):
                await c.set_retention([("a/#", 10), ("a/#", 20)])
            async with aio.Client(cluster.addresses, timeout_s=10) as anonymous:
                with pytest.raises(E.AuthenticationError):
                    await anonymous.set_retention(rules)
            return policy, seen

    policy, seen = run(scenario())
    assert [(r.topic_filter, r.period_s) for r in policy.rules] == rules and policy.default_s == 86_400
    assert seen == policy
    with cluster.client(timeout_s=20) as sync:
        assert sync.retention() == policy
    run(_keep_everything(cluster))


async def _keep_everything(cluster: LocalCluster) -> None:
    async with admin(cluster) as c:
        await c.set_retention([], default_s=0)


def test_fetch_offline_of_some_shards_and_a_share_group_from_asyncio(cluster: LocalCluster) -> None:
    senders = [sender_on(shard, "aiosh", N_SHARDS) for shard in range(N_SHARDS)]
    batch = [Message(f"aiosh/{i}", f"{i}".encode(), sender=senders[i % N_SHARDS], qos=1) for i in range(40)]

    async def scenario() -> tuple[list[Message], list[Message], list[Message], list[list[Message]], list[Message]]:
        async with aio.Client(cluster.addresses, timeout_s=30) as c:
            stored = await c.store_batch(batch)
            some = await c.fetch_offline("aiosh-reader", "aiosh/#", shards=iter([3, 1, 3]))
            every = await c.fetch_offline("aiosh-reader", "aiosh/#")
            with pytest.raises(ValueError, match="start must be"):
                aio.AsyncSharedSubscription(c, "aiosh-g", "aiosh/#", "m-x", start="later")
            a = aio.AsyncSharedSubscription(c, "aiosh-g", "aiosh/#", "m-a", start="earliest")
            b = aio.AsyncSharedSubscription(c, "aiosh-g", "aiosh/#", "m-b", start="earliest")
            assert (await a.join()).shards == list(range(N_SHARDS))  # alone: every shard
            joined = await b.join()
            assert joined.members == ["m-a", "m-b"] and joined.position_clientid == "$share/aiosh-g"
            await a.join()  # a renews: it learns that b took half
            assert sorted(a.shards + b.shards) == list(range(N_SHARDS)) and not set(a.shards) & set(b.shards)
            pages = [await a.fetch(100), await b.fetch(100)]
            for member, page in zip((a, b), pages, strict=True):
                for m in page:
                    await member.ack(m)
            await b.leave()
            assert (await a.join()).shards == list(range(N_SHARDS))  # b's shards came to a
            left = await a.fetch(100)  # after the group's position, which b moved in its shards
            return stored, some, every, pages, left

    stored, some, every, pages, left = run(scenario())
    assert [m.payload for m in every] == [m.payload for m in sorted(stored, key=lambda m: (m.timestamp_us, m.shard))]
    assert some == [m for m in every if m.shard in (1, 3)] and some
    with cluster.client(timeout_s=20) as sync:
        assert sync.fetch_offline("aiosh-reader", "aiosh/#", shards=[1, 3]) == some
    a_page, b_page = pages
    assert sorted(m.payload for m in a_page + b_page) == sorted(m.payload for m in stored)  # each message once
    assert {m.shard for m in a_page}.isdisjoint({m.shard for m in b_page})
    assert left == []  # everything acknowledged: nothing comes again


@pytest.mark.slow
def test_an_iterator_continues_after_its_leader_is_killed(cluster: LocalCluster) -> None:
    # Last in the module: it kills a node (and starts it again).
    shard = 1
    sender = sender_on(shard, "fo", N_SHARDS)

    def batch(start: int, count: int) -> list[Message]:
        return [
            Message(topic="fo/seq", payload=str(i).encode(), sender=sender, qos=1) for i in range(start, start + count)
        ]

    victim = cluster.wait_for_leader(shard)

    async def scenario() -> list[int]:
        async with aio.Client(cluster.addresses, timeout_s=30) as client:
            for start in range(0, 300, 50):
                await client.store_batch(batch(start, 50))
            ((_, stream),) = await client.get_streams("fo/seq")
            it = await client.make_iterator(stream, "fo/seq")
            first = await client.next(it, batch_size=120)
            read = [int(m.payload) for m in first.messages]
            it = first.iterator
            cluster.kill(victim)
            # Written through the new leader after the kill, read with the same iterator.
            await client.store_batch(batch(300, 50))
            while True:
                result = await client.next(it, batch_size=70)
                read += [int(m.payload) for m in result.messages]
                it = result.iterator
                if not result.messages:
                    return read

    try:
        read = run(scenario(), timeout_s=90)
        assert read == list(range(350)), "a message was skipped or repeated"
        assert cluster.leader(shard) != victim
    finally:
        cluster.start_node(victim)

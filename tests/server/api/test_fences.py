"""Read fences on a real 3-node cluster: reading up to a shard's fence gives the same messages from every replica."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from mqds.client import Client, Fence, Message, MessageBatch, Stream, aio
from mqds.client.model import Iterator as StreamIterator
from mqds.tools.local_cluster import LocalCluster
from mqds.v1 import storage_pb2 as pb
from mqds.v1 import storage_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

N_SHARDS = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("fences") / "c", 3, n_shards=N_SHARDS) as c:
        c.start()
        yield c


def read_to_fence(stub: pb_grpc.StorageStub, fence: Fence, topic_filter: str) -> list[tuple[int, bytes]]:
    """Every message of ``fence.shard`` matching the filter up to the fence, read from one node (stale_ok)."""
    streams = stub.GetStreams(
        pb.GetStreamsRequest(topic_filter=topic_filter, shards=[fence.shard], stale_ok=True), timeout=10
    ).streams
    out: list[tuple[int, bytes]] = []
    for ranked in streams:
        made = stub.MakeIterator(
            pb.MakeIteratorRequest(stream=ranked.stream, topic_filter=topic_filter, stale_ok=True), timeout=10
        )
        iterator = made.iterator
        while True:
            response = stub.Next(
                pb.NextRequest(iterator=iterator, batch_size=7, stale_ok=True, fence_us=fence.timestamp_us), timeout=10
            )
            out.extend((m.timestamp_us, m.payload) for m in response.messages)
            iterator = response.iterator
            if response.end_of_stream:
                break
    return sorted(out)


def test_every_replica_returns_the_same_snapshot_up_to_the_fence(cluster: LocalCluster) -> None:
    with Client(cluster.addresses, timeout_s=30) as client:
        client.store_batch([Message(f"fence/{i % 4}/v", str(i).encode(), sender=f"s{i % 6}") for i in range(120)])
        fences = client.get_fences()
        assert [f.shard for f in fences] == list(range(N_SHARDS))
        assert all(f.timestamp_us > 0 and f.applied_index > 0 and f.generations for f in fences)
        assert fences[0].generations[-1].current
        assert all(len(f.estimated_keys) == len(f.generations) for f in fences)
        # Writes after the fence are not part of the snapshot.
        client.store_batch([Message(f"fence/{i % 4}/v", b"later", sender=f"s{i % 6}") for i in range(60)])
        for fence in fences:
            answers = [
                read_to_fence(pb_grpc.StorageStub(grpc.insecure_channel(address)), fence, "fence/#")
                for address in cluster.addresses
            ]
            assert answers[0] and all(answer == answers[0] for answer in answers), fence.shard
            assert b"later" not in {payload for _, payload in answers[0]}
            assert max(ts for ts, _ in answers[0]) <= fence.timestamp_us
        assert (
            sum(
                len(read_to_fence(pb_grpc.StorageStub(grpc.insecure_channel(cluster.addresses[0])), f, "fence/1/v"))
                for f in fences
            )
            == 30
        )


def one_stream(cluster: LocalCluster, name: str) -> tuple[Stream, StreamIterator, pb_grpc.StorageStub]:
    """One message stored as ``name/x`` by sender ``name``: its stream, an iterator on it, a stub to node 1."""
    with Client(cluster.addresses, timeout_s=30) as client:
        client.store_batch([Message(f"{name}/x", b"1", sender=name)])
        _, stream = client.get_streams(f"{name}/#")[0]
        iterator = client.make_iterator(stream, f"{name}/#")
    return stream, iterator, pb_grpc.StorageStub(grpc.insecure_channel(cluster.addresses[0]))


def test_a_fence_ahead_of_a_replica_is_refused_as_retriable(cluster: LocalCluster) -> None:
    _, iterator, stub = one_stream(cluster, "ahead")
    # A fence a minute ahead: no write has reached it yet (a fence more than a day ahead of the
    # node's clock is not one GetFences could have given, and is refused as invalid).
    ahead = int(time.time() * 1_000_000) + 60_000_000
    request = pb.NextRequest(iterator=iterator.to_pb(), batch_size=10, stale_ok=True, fence_us=ahead)
    with pytest.raises(grpc.RpcError) as behind:
        stub.Next(request, timeout=10)
    assert behind.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "not yet the fence" in (behind.value.details() or "")


def test_replay_reads_to_the_fences_of_its_start_while_writes_go_on(cluster: LocalCluster) -> None:
    """Replay holds every message acknowledged before it began, ends although writers keep writing, once each."""
    stop = threading.Event()
    acknowledged: list[Message] = []
    with Client(cluster.addresses, timeout_s=30) as client:

        def write() -> None:
            i = 0
            while not stop.is_set():
                batch = [Message(f"replayfence/{s}/x", f"{i}".encode(), sender=f"rf-{s}", qos=1) for s in range(6)]
                acknowledged.extend(client.store_batch(batch))
                i += 1

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        try:
            while len(acknowledged) < 600:
                time.sleep(0.05)
            before = list(acknowledged)
            started = time.monotonic()
            batches = list(client.replay_batches("replayfence/#", batch_size=50, read_ahead=2))
            took = time.monotonic() - started
        finally:
            stop.set()
            writer.join(30)
        assert took < 20, f"replay took {took:.1f} s while writes went on"
        got = [(m.shard, m.timestamp_us) for b in batches for m in b]
        assert all(0 < len(b) <= 50 for b in batches)
        assert len(got) == len(set(got)), "a message came twice"
        missing = {(m.shard, m.timestamp_us) for m in before} - set(got)
        assert not missing, f"{len(missing)} messages acknowledged before the replay began are not in it"
        per_sender: dict[str, list[int]] = {}
        for b in batches:
            for m in b:
                per_sender.setdefault(m.sender, []).append(int(m.payload))
        assert all(seq == sorted(seq) for seq in per_sender.values()), "a sender's messages out of order"
        # With the writer stopped, both forms return the same messages, and so does the asyncio client.
        everything = list(client.replay("replayfence/#"))
        assert [m for b in client.replay_batches("replayfence/#") for m in b] == everything

    async def replay_aio() -> tuple[list[MessageBatch], list[Message]]:
        async with aio.Client(cluster.addresses, timeout_s=30) as aclient:
            batches = [b async for b in aclient.replay_batches("replayfence/#", batch_size=50, read_ahead=2)]
            return batches, [m async for m in aclient.replay("replayfence/#")]

    aio_batches, aio_messages = asyncio.run(replay_aio())
    assert all(0 < len(b) <= 50 for b in aio_batches)
    assert [m for b in aio_batches for m in b] == everything and aio_messages == everything


def _read_all(client: Client, stream: Stream, topic_filter: str, fence: int, first: bool) -> list[list[bytes]]:
    """The stream's payloads up to the fence, batch by batch: started by ``first_batch`` or by ``make_iterator``."""
    if first:
        result = client.first_batch(stream, topic_filter, 0, 7, stale_ok=True, fence_us=fence)
    else:
        result = client.next(client.make_iterator(stream, topic_filter), 7, stale_ok=True, fence_us=fence)
    batches = []
    while True:
        batches.append([m.payload for m in result.messages])
        if result.end_of_stream:
            return batches
        result = client.next(result.iterator, 7, stale_ok=True, fence_us=fence)


def test_a_streams_first_batch_comes_with_its_iterator_in_one_call(cluster: LocalCluster) -> None:
    """``first_batch`` (NextRequest.start) reads what make_iterator then next read, and goes on from there."""
    with Client(cluster.addresses, timeout_s=30) as client:
        client.store_batch([Message(f"first/{i % 3}/v", str(i).encode(), sender=f"f{i % 5}") for i in range(90)])
        fences = {f.shard: f.timestamp_us for f in client.get_fences()}
        streams = [stream for _, stream in client.get_streams("first/#")]
        assert streams
        for stream in streams:
            made = _read_all(client, stream, "first/#", fences[stream.shard], first=False)
            assert _read_all(client, stream, "first/#", fences[stream.shard], first=True) == made
        total = sum(len(b) for s in streams for b in _read_all(client, s, "first/#", fences[s.shard], first=True))
        assert total == 90
        # A narrower filter and a start time, as make_iterator takes them.
        _, narrow = client.get_streams("first/1/v")[0]
        fence = fences[narrow.shard]
        whole = client.first_batch(narrow, "first/1/v", 0, 1000, stale_ok=True, fence_us=fence)
        assert whole.end_of_stream and len(whole.messages) > 1
        assert all(m.topic == "first/1/v" for m in whole.messages)
        after = whole.messages[0].timestamp_us + 1
        rest = client.first_batch(narrow, "first/1/v", after, 1000, fence_us=fence)
        assert list(rest.messages) == list(whole.messages)[1:]

    async def first_aio() -> list[bytes]:
        async with aio.Client(cluster.addresses, timeout_s=30) as aclient:
            result = await aclient.first_batch(streams[0], "first/#", 0, 1000, fence_us=fences[streams[0].shard])
            return [m.payload for m in result.messages]

    assert asyncio.run(first_aio()) == [
        p for b in _read_all(client, streams[0], "first/#", fences[streams[0].shard], True) for p in b
    ]


def test_a_bad_start_is_refused_with_the_reason(cluster: LocalCluster) -> None:
    stream, iterator, stub = one_stream(cluster, "badstart")
    start = pb.IteratorStart(stream=stream.to_pb(), topic_filter="badstart/#")
    cases = [
        (pb.NextRequest(iterator=iterator.to_pb(), start=start, batch_size=1), "INVALID_ARGUMENT", "not both"),
        (pb.NextRequest(start=pb.IteratorStart(topic_filter="badstart/#"), batch_size=1), "INVALID_ARGUMENT", "stream"),
        (
            pb.NextRequest(start=pb.IteratorStart(stream=stream.to_pb(), topic_filter="a/#/b"), batch_size=1),
            "INVALID_ARGUMENT",
            "#",
        ),
        (pb.NextRequest(start=start, batch_size=0), "INVALID_ARGUMENT", "batch_size"),
    ]
    unknown = pb.Stream(shard=stream.shard, generation=stream.generation, id=987_654, pattern="badstart/x")
    cases.append(
        (
            pb.NextRequest(
                start=pb.IteratorStart(stream=unknown, topic_filter="badstart/#"), batch_size=1, stale_ok=True
            ),
            "NOT_FOUND",
            "no stream",
        )
    )
    # A fence ahead of every replica: refused as retriable before the stream is looked up (a replica
    # that far behind may not know it yet).
    ahead = int(time.time() * 1_000_000) + 60_000_000
    cases.append(
        (
            pb.NextRequest(
                start=pb.IteratorStart(stream=unknown, topic_filter="badstart/#"),
                batch_size=1,
                stale_ok=True,
                fence_us=ahead,
            ),
            "UNAVAILABLE",
            "not yet the fence",
        )
    )
    for request, code, words in cases:
        with pytest.raises(grpc.RpcError) as refused:
            stub.Next(request, timeout=10)
        assert refused.value.code().name == code, (request, refused.value.details())
        assert words in (refused.value.details() or ""), (request, refused.value.details())

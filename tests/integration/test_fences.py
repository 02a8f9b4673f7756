"""Read fences on a real 3-node cluster: reading up to a shard's fence gives the same messages from every replica."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from mqds.client import Client, Fence, Message, MessageBatch, aio
from mqds.tools.localproc import LocalCluster
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


def test_a_fence_ahead_of_a_replica_is_refused_as_retriable(cluster: LocalCluster) -> None:
    with Client(cluster.addresses, timeout_s=30) as client:
        client.store_batch([Message("ahead/x", b"1", sender="ahead")])
        _, stream = client.get_streams("ahead/#")[0]
        iterator = client.make_iterator(stream, "ahead/#")
    stub = pb_grpc.StorageStub(grpc.insecure_channel(cluster.addresses[0]))
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

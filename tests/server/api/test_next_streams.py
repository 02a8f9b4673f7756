"""A read that goes on into further streams (``NextRequest.then``): one call for many short streams.

A real node with a small ``max_answer_bytes``: reading a shard's streams with
``then`` gives the messages a stream-by-stream read gives, in the same order,
for any batch size; no answer passes the byte bound (a later stream's first
message that does not fit waits for the next call); bad requests are refused
with the reason.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from mqds.client import Client, Message, MessageBatch, Stream, aio
from mqds.spark.plan import Slice
from mqds.spark.reading import _stream_batches
from mqds.tools.local_cluster import LocalCluster
from mqds.v1 import storage_pb2 as pb
from mqds.v1 import storage_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

ANSWER_BYTES = 256 * 1024
SENDER = "then-sender"  # one sender: one shard


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    base = tmp_path_factory.mktemp("next-streams") / "c"
    with LocalCluster(base, 1, n_shards=2, args=[f"--max-answer-bytes={ANSWER_BYTES}"]) as c:
        c.start()
        yield c


@pytest.fixture(scope="module")
def stored(cluster: LocalCluster) -> tuple[list[Stream], int]:
    """Streams of one shard and generation: short ones, an empty-after-filter one, and large messages."""
    with Client(cluster.addresses, timeout_s=30) as client:
        batch = []
        for i in range(300):
            topic = f"then/{i % 14}/v"  # ten literal streams, then the rest in one wildcard stream
            size = 50_000 if i % 37 == 0 else 20
            batch.append(Message(topic, f"{i}:".encode() + b"x" * size, sender=SENDER))
        client.store_batch(batch)
        streams = [stream for _, stream in client.get_streams("then/#")]
        fence = next(f.timestamp_us for f in client.get_fences() if f.shard == streams[0].shard)
    assert len(streams) >= 10 and len({(s.shard, s.generation) for s in streams}) == 1
    return streams, fence


def _one_by_one(client: Client, streams: list[Stream], fence: int) -> list[bytes]:
    out: list[bytes] = []
    for stream in streams:
        result = client.first_batch(stream, "then/#", 0, 10_000, fence_us=fence)
        out += [m.payload for m in result.messages]
        while not result.end_of_stream:
            result = client.next(result.iterator, 10_000, fence_us=fence)
            out += [m.payload for m in result.messages]
    return out


@pytest.mark.parametrize("batch_size", [1, 4, 25, 10_000])
def test_reading_on_into_the_next_streams_gives_the_same_messages(
    cluster: LocalCluster, stored: tuple[list[Stream], int], batch_size: int
) -> None:
    streams, fence = stored
    with Client(cluster.addresses, timeout_s=30) as client:
        expected = _one_by_one(client, streams, fence)
        assert len(expected) == 300
        part = Slice(streams[0].shard, streams[0].generation, tuple(streams), "then/#", 0, fence)
        batches = list(_stream_batches(client, part, streams, batch_size))
    assert [m.payload for b in batches for m in b] == expected
    assert all(0 < len(b) <= batch_size and b.nbytes <= ANSWER_BYTES for b in batches)


def test_an_answer_says_how_many_streams_it_finished(cluster: LocalCluster, stored: tuple[list[Stream], int]) -> None:
    """An answer cut inside a later stream: streams_done counts the finished ones, the iterator goes on from the cut."""
    streams, fence = stored
    with Client(cluster.addresses, timeout_s=30) as client:
        alone = [_one_by_one(client, [s], fence) for s in streams[1:4]]
        cut = len(alone[0]) + len(alone[1]) // 2  # halfway through the second stream
        whole = client.first_batch(streams[1], "then/#", 0, cut, fence_us=fence, then=streams[2:4])
        assert [m.payload for m in whole.messages] == [p for a in alone for p in a][:cut]
        assert whole.streams_done == 1 and not whole.end_of_stream
        rest: list[bytes] = []
        result = whole
        while not result.end_of_stream:
            result = client.next(result.iterator, 100, fence_us=fence)
            rest += [m.payload for m in result.messages]
        assert rest == alone[1][len(alone[1]) // 2 :]
        # Batches of 100 leave the answer most of its 256 KiB: the three streams fit in one.
        everything = client.first_batch(streams[1], "then/#", 0, 100, fence_us=fence, then=streams[2:4])
    if sum(len(p) for a in alone for p in a) < ANSWER_BYTES * 3 // 4:
        assert everything.streams_done == 3 and everything.end_of_stream
        assert [m.payload for m in everything.messages] == [p for a in alone for p in a]


def test_then_is_refused_where_it_cannot_mean_anything(cluster: LocalCluster, stored: tuple[list[Stream], int]) -> None:
    streams, fence = stored
    stub = pb_grpc.StorageStub(grpc.insecure_channel(cluster.addresses[0]))

    def start(stream: Stream | pb.Stream) -> pb.IteratorStart:
        raw = stream.to_pb() if isinstance(stream, Stream) else stream
        return pb.IteratorStart(stream=raw, topic_filter="then/#")

    other = pb.Stream(shard=streams[0].shard, generation=streams[0].generation + 1, id=1, pattern="then/+/v")
    with Client(cluster.addresses, timeout_s=30) as client:
        iterator = client.make_iterator(streams[0], "then/#").to_pb()
    cases = [
        (pb.NextRequest(start=start(streams[0]), then=[start(streams[1])], batch_size=5), "needs fence_us"),
        (pb.NextRequest(iterator=iterator, then=[start(streams[1])], batch_size=5, fence_us=fence), "goes with start"),
        (pb.NextRequest(start=start(streams[0]), then=[start(other)], batch_size=5, fence_us=fence), "generation"),
        (
            pb.NextRequest(start=start(streams[0]), then=[start(streams[1])] * 1001, batch_size=5, fence_us=fence),
            "NextRequest.then holds 1,001 entries; at most 1,000",
        ),
    ]
    for request, words in cases:
        with pytest.raises(grpc.RpcError) as refused:
            stub.Next(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
        assert words in (refused.value.details() or ""), refused.value.details()


def _counted(client: Any, calls: list[str]) -> None:
    """Count the client's first_batch and next calls (the replay's reads)."""
    for name in ("first_batch", "next"):
        method = getattr(client, name)

        def counting(*args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Any:
            calls.append(_name)
            return _method(*args, **kwargs)

        setattr(client, name, counting)


def _check_replay(batches: list[MessageBatch], batch_size: int) -> None:
    """Every message once, in the order stored (one store call: timestamps in message order), batches bounded."""
    assert [int(m.payload.split(b":")[0]) for b in batches for m in b] == list(range(300))
    times = [t for b in batches for t in b.times]
    assert times == sorted(times) and len(set(times)) == 300
    assert all(0 < len(b) <= batch_size for b in batches)


@pytest.mark.parametrize("batch_size", [1, 7, 1000])
def test_a_replay_reads_a_ranks_short_streams_in_few_calls_and_merges_them_by_time(
    cluster: LocalCluster, stored: tuple[list[Stream], int], batch_size: int
) -> None:
    """A replay merges a generation's streams by time. Read with answers that go on from stream to stream (cut
    into runs of increasing timestamps for the merge), the eleven interleaved streams come back in the order the
    messages were stored, each once, in fewer calls than streams (before: a call per stream at least)."""
    streams, _ = stored
    calls: list[str] = []
    with Client(cluster.addresses, timeout_s=30) as client:
        _counted(client, calls)
        batches = list(client.replay_batches("then/#", batch_size=batch_size))
    _check_replay(batches, batch_size)
    if batch_size == 1000:  # an answer has room for several streams (10,000 would reserve all of it for framing)
        assert len(calls) < len(streams), calls


def test_the_asyncio_replay_reads_a_ranks_short_streams_in_few_calls_too(
    cluster: LocalCluster, stored: tuple[list[Stream], int]
) -> None:
    streams, _ = stored
    calls: list[str] = []

    async def replay() -> list[MessageBatch]:
        async with aio.Client(cluster.addresses, timeout_s=30) as client:
            _counted(client, calls)
            return [b async for b in client.replay_batches("then/#", batch_size=1000)]

    _check_replay(asyncio.run(replay()), 1000)
    assert len(calls) < len(streams), calls

"""MessageBatch (a view over answers), the replay's read-ahead and merge: order, bounds, errors, early stop."""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqds.client import Iterator as StreamIterator
from mqds.client import Message, MessageBatch, NextResult, Stream
from mqds.client.batch import wire_times
from mqds.client.core.merge import runs
from mqds.client.core.next_answer import next_result, parsed_next_result
from mqds.client.core.stream_reads import RankRead, ReadAhead
from mqds.client.sync.reads import merged, merged_from, rank_sources
from mqds.client.sync.replay import read_ahead
from mqds.protocol.errors import GenerationDroppedError, Reason
from mqds.v1 import storage_pb2 as pb


def _answer(n: int, first_ts: int = 1, step: int = 1, sender: str = "s") -> pb.NextResponse:
    answer = pb.NextResponse()
    for i in range(n):
        m = answer.messages.add(topic=f"t/{i}", payload=bytes([i % 256]) * 3, sender=sender, qos=1)
        m.timestamp_us = first_ts + i * step
        m.shard = 2
        if i % 2:
            m.properties.add(key="k", value=str(i))
    # As a node's answer arrives: bytes, parsed.
    return pb.NextResponse.FromString(answer.SerializeToString())


def test_a_batch_gives_the_same_messages_as_objects_and_as_columns() -> None:
    answer = _answer(5)
    batch = MessageBatch(answer.messages)
    objects = [Message.from_pb(m) for m in answer.messages]
    assert len(batch) == 5 and bool(batch)
    assert list(batch) == objects and batch == objects and batch[1] == objects[1] and batch[-1] == objects[-1]
    assert batch[1:3] == objects[1:3] and isinstance(batch[1:3], MessageBatch)
    assert batch.topics() == [m.topic for m in objects]
    assert batch.payloads() == [m.payload for m in objects]
    assert batch.senders() == ["s"] * 5 and batch.qos() == [1] * 5 and batch.retain() == [False] * 5
    assert batch.timestamps() == [1, 2, 3, 4, 5] and batch.last_timestamp_us() == 5
    assert batch.properties() == [m.properties for m in objects]
    assert batch.properties()[1] == (("k", "1"),)
    assert batch != objects[:4] and not MessageBatch() and MessageBatch().last_timestamp_us() is None


def test_streams_of_one_rank_merge_by_timestamp_in_batches_of_the_size_asked() -> None:
    even = [MessageBatch(_answer(3, 0, 2, "a").messages), MessageBatch(_answer(3, 6, 2, "a").messages)]
    odd = [MessageBatch(_answer(6, 1, 2, "b").messages)]
    out = list(merged([iter(even), iter(odd)], 4))
    assert all(0 < len(b) <= 4 for b in out)
    assert [ts for b in out for ts in b.timestamps()] == list(range(12))
    assert [m.sender for b in out for m in b] == ["a", "b"] * 6
    # Uneven streams, many batches each, one ending early: everything once, in order.
    rng = random.Random(7)
    stamps = sorted(rng.sample(range(100_000), 3000))
    streams: list[list[int]] = [[], [], []]
    for ts in stamps:
        streams[rng.choice([0, 0, 1, 2]) if ts < 60_000 else rng.choice([0, 1])].append(ts)

    def batches(own: list[int]) -> Iterator[MessageBatch]:
        cut = 0
        while cut < len(own):
            size = rng.randint(1, 300)
            answer = pb.NextResponse()
            for ts in own[cut : cut + size]:
                answer.messages.add(topic="t", timestamp_us=ts)
            yield MessageBatch(answer.messages)
            cut += size

    out = list(merged([batches(own) for own in streams], 250))
    assert all(0 < len(b) <= 250 for b in out)
    assert [ts for b in out for ts in b.timestamps()] == stamps
    alone = list(merged([iter(even)], 4))
    assert alone == even  # one stream: its batches as they came


def test_the_merge_orders_by_the_timestamps_the_node_sent_beside_the_messages() -> None:
    """With ``NextResponse.timestamps`` the merge reads those, not the messages; the merged batch is a view."""
    rng = random.Random(11)
    stamps = sorted(rng.sample(range(1, 10**9), 2000))
    owners = [rng.randrange(3) for _ in stamps]

    def node_batches(k: int) -> Iterator[MessageBatch]:
        own = [ts for ts, o in zip(stamps, owners, strict=True) if o == k]
        cut = 0
        while cut < len(own):
            size = rng.randint(1, 400)
            answer = pb.NextResponse(timestamps=b"".join(ts.to_bytes(8, "little") for ts in own[cut : cut + size]))
            for ts in own[cut : cut + size]:
                answer.messages.add(topic=f"s{k}/{ts}", sender=f"s{k}", timestamp_us=ts)
            answer = pb.NextResponse.FromString(answer.SerializeToString())
            yield MessageBatch(answer.messages, wire_times(answer.timestamps))
            cut += size

    out = list(merged([node_batches(k) for k in range(3)], 300))
    assert all(0 < len(b) <= 300 for b in out) and sum(map(len, out)) == len(stamps)
    # Read by index before anything was iterated (each message looked up in its source batch), then iterated.
    offset = len(out[0])
    assert [out[1][i].timestamp_us for i in range(len(out[1]))] == stamps[offset : offset + len(out[1])]
    assert [m.timestamp_us for m in out[1].wire[::-1]] == stamps[offset : offset + len(out[1])][::-1]
    assert [ts for b in out for ts in b.times] == stamps
    assert [ts for b in out for ts in b.timestamps()] == stamps
    assert [m.timestamp_us for b in out for m in b] == stamps  # the messages themselves, in the same order
    assert [t for b in out for t in b.topics()] == [f"s{o}/{ts}" for ts, o in zip(stamps, owners, strict=True)]
    first = out[0]
    assert first[-1].timestamp_us == first.last_timestamp_us() == stamps[len(first) - 1]
    assert first[2:5].timestamps() == stamps[2:5] and [m.timestamp_us for m in first.wire[2:5]] == stamps[2:5]
    # The times decide: messages whose own timestamp_us says otherwise still come in the order of the times.
    late = pb.NextResponse(timestamps=(3).to_bytes(8, "little"))
    late.messages.add(topic="late", timestamp_us=0)
    early = pb.NextResponse(timestamps=(1).to_bytes(8, "little"))
    early.messages.add(topic="early", timestamp_us=9)
    sources = [iter([MessageBatch(a.messages, wire_times(a.timestamps))]) for a in (late, early)]
    assert [m.topic for b in merged(sources, 10) for m in b] == ["early", "late"]


def _source(name: str, n: int, taken: list[str] | None = None, fail_at: int | None = None) -> Iterator[str]:
    for i in range(n):
        if i == fail_at:
            raise RuntimeError(f"{name} failed at {i}")
        if taken is not None:
            taken.append(f"{name}{i}")
        yield f"{name}{i}"


def test_read_ahead_hands_on_sources_in_order_whatever_finishes_first() -> None:
    def slow() -> Iterator[str]:
        time.sleep(0.2)
        yield from _source("a", 3)

    got = list(
        read_ahead([slow, lambda: _source("b", 2), lambda: _source("c", 0), lambda: _source("d", 1)], ReadAhead(3, 2))
    )
    assert got == ["a0", "a1", "a2", "b0", "b1", "d0"]


def test_read_ahead_keeps_at_most_depth_items_per_source_and_ahead_sources_running() -> None:
    taken: dict[str, list[str]] = {name: [] for name in "abc"}
    items = read_ahead([lambda n=name: _source(n, 100, taken[n]) for name in "abc"], ReadAhead(2, 3))
    assert next(items) == "a0"
    time.sleep(0.3)
    # a: the one taken, 3 queued and 1 waiting for room; b: 3 queued, 1 waiting; c not started.
    assert len(taken["a"]) <= 5 and len(taken["b"]) <= 4 and not taken["c"]
    items.close()


def test_read_ahead_bounded_in_bytes_holds_what_fits_and_one_item_at_least() -> None:
    """Replays read ahead by bytes, not by a few batches: a source of small items runs far ahead within
    the budget, one of items larger than the budget still hands on one at a time."""
    taken: dict[str, list[str]] = {name: [] for name in "ab"}
    weights = {"a": 10, "b": 40}
    items = read_ahead(
        [lambda n=name: _source(n, 100, taken[n]) for name in "ab"],
        ReadAhead(2, 50, max_bytes=25, weigh=lambda i: weights[i[0]]),
    )
    assert next(items) == "a0"
    time.sleep(0.3)
    # a: a1 and a2 fit in 25 bytes, a3 waits for room; b: b0 although it weighs 40, b1 waits.
    assert len(taken["a"]) <= 4 and len(taken["b"]) <= 2
    assert [next(items) for _ in range(5)] == ["a1", "a2", "a3", "a4", "a5"]
    items.close()


def test_merged_batches_carry_their_share_of_the_answers_bytes() -> None:
    rng = random.Random(5)
    stamps = sorted(rng.sample(range(100_000), 3000))
    owners = [rng.randrange(3) for _ in stamps]
    sources = []
    total = 0
    for owner in range(3):
        own = [ts for ts, o in zip(stamps, owners, strict=True) if o == owner]
        batches = []
        for cut in range(0, len(own), 400):
            part = own[cut : cut + 400]
            nbytes = 37 * len(part)  # as if each message took 37 bytes on the wire
            total += nbytes
            answer = pb.NextResponse()
            for ts in part:
                answer.messages.add(topic="t", sender=f"s{owner}", timestamp_us=ts)
            batches.append(MessageBatch(answer.messages, part, nbytes))
        sources.append(iter(batches))
    out = list(merged(sources, 250))
    assert sum(len(b) for b in out) == 3000
    assert total - len(out) <= sum(b.nbytes for b in out) <= total
    assert all(abs(b.nbytes - 37 * len(b)) <= 1 for b in out)
    assert out[0][:100].nbytes == out[0].nbytes * 100 // len(out[0])


def test_a_source_error_comes_in_its_place_after_the_items_before_it() -> None:
    items = read_ahead([lambda: _source("a", 2), lambda: _source("b", 5, fail_at=1)], ReadAhead(2, 2))
    assert next(items) == "a0" and next(items) == "a1" and next(items) == "b0"
    with pytest.raises(RuntimeError, match="b failed at 1"):
        next(items)


def test_closing_a_read_ahead_stops_its_readers() -> None:
    closed = threading.Event()

    def endless() -> Iterator[int]:
        try:
            n = 0
            while True:
                n += 1
                yield n
        finally:
            closed.set()

    items = read_ahead([endless], ReadAhead(1, 2))
    assert next(items) == 1
    items.close()
    assert closed.wait(2), "the reader kept its source open after the replay was closed"
    with pytest.raises(ValueError, match="ahead and depth of 1 or more"):
        next(read_ahead([endless], ReadAhead(0, 1)))


def test_a_next_answer_comes_with_its_size_on_the_wire() -> None:
    answer = _answer(7)
    answer.iterator.shard = 2
    answer.iterator.generation = 3
    answer.iterator.state = b"position"
    answer.end_of_stream = True
    raw = answer.SerializeToString()
    for read in (next_result, parsed_next_result):
        result = read(raw)
        assert result.messages.nbytes == len(raw)
        assert list(result.messages) == [Message.from_pb(m) for m in answer.messages]
        assert result.iterator.to_pb() == answer.iterator and result.end_of_stream


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_answers_that_went_on_from_stream_to_stream_merge_back_into_time_order(data: st.DataObject) -> None:
    """A replay reads a rank's short streams in answers that hold them one after the other (``then``), cut into runs
    of increasing timestamps; merged, every message comes once, in time order, however the streams interleave and
    wherever the answers were cut (a stream split over two answers included)."""
    stamps = data.draw(st.lists(st.integers(1, 10_000), min_size=1, max_size=200, unique=True))
    n_streams = data.draw(st.integers(1, 8))
    owner = [data.draw(st.integers(0, n_streams - 1)) for _ in stamps]
    streams = [sorted(t for t, o in zip(stamps, owner, strict=True) if o == s) for s in range(n_streams)]
    flat = [t for stream in streams for t in stream]  # how the node answers: stream after stream
    cuts = sorted(data.draw(st.sets(st.integers(1, len(flat) - 1), max_size=5)) if len(flat) > 1 else set())
    answers = [flat[a:b] for a, b in itertools.pairwise([0, *cuts, len(flat)])]
    live = [
        (iter(()), rest)
        for times in answers
        for rest in runs(MessageBatch([pb.Message(timestamp_us=t) for t in times], times, 10 * len(times)))
    ]
    batch_size = data.draw(st.integers(1, 50))
    out = list(merged_from(live, batch_size))
    assert [t for b in out for t in b.times] == sorted(stamps)
    assert [m.timestamp_us for b in out for m in b.wire] == sorted(stamps)
    assert all(0 < len(b) <= batch_size for b in out)


def _dropped() -> GenerationDroppedError:
    return GenerationDroppedError(Reason.GENERATION_DROPPED, "generation 1 of shard 0 was dropped")


def test_a_generation_dropped_while_a_rank_is_read_hands_its_unread_streams_to_on_dropped() -> None:
    """A replay reads a rank's streams in answers that go on from one to the next; when retention drops the
    generation meanwhile, what was read is merged and handed on, and every stream not read to its end goes to
    ``on_dropped`` (or, without it, the error is raised)."""
    streams = [Stream(shard=0, generation=1, id=i, pattern="t/+") for i in range(5)]
    position = StreamIterator(shard=0, generation=1, state=b"at-stream-2")

    class Replaying:  # no cluster: a client's first_batch and next, which is all a rank's reads use
        def __init__(self) -> None:
            self.calls: list[int] = []

        def first_batch(self, stream: Stream, *args: Any, **kwargs: Any) -> NextResult:
            self.calls.append(stream.id)
            if stream.id == 3:
                raise _dropped()
            # Streams 0 and 1 read to their end, stream 2 begun: stream after stream, each in time order.
            times = [5, 9, 2, 7, 4]
            messages = MessageBatch([pb.Message(timestamp_us=t) for t in times], times, 50)
            return NextResult(messages, position, end_of_stream=False, streams_done=2)

        def next(self, iterator: StreamIterator, *args: Any, **kwargs: Any) -> NextResult:
            assert iterator == position
            raise _dropped()

    client = Replaying()
    dropped: list[Stream] = []
    live = rank_sources(client, RankRead("t/#", 0, 10, 1_000, dropped.append), streams)
    assert [t for b in merged_from(live, 10) for t in b.times] == [2, 4, 5, 7, 9]
    assert client.calls == [0, 3] and dropped == streams[2:]
    with pytest.raises(GenerationDroppedError):
        rank_sources(Replaying(), RankRead("t/#", 0, 10, 1_000, None), streams)

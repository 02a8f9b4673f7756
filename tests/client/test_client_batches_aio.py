"""The asyncio client's replay path: rank groups read ahead in tasks, streams merged a batch at a time."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable

import pytest

from mqds.client import MessageBatch
from mqds.client.aio.reads import merged
from mqds.client.aio.replay import read_ahead
from mqds.client.core.stream_reads import ReadAhead
from mqds.v1 import storage_pb2 as pb


def _batch(stamps: list[int], sender: str = "s") -> MessageBatch:
    answer = pb.NextResponse()
    for ts in stamps:
        answer.messages.add(topic="t", sender=sender, timestamp_us=ts)
    return MessageBatch(pb.NextResponse.FromString(answer.SerializeToString()).messages)


async def _source(name: str, n: int, taken: list[str] | None = None, fail_at: int | None = None) -> AsyncIterator[str]:
    for i in range(n):
        await asyncio.sleep(0)
        if i == fail_at:
            raise RuntimeError(f"{name} failed at {i}")
        if taken is not None:
            taken.append(f"{name}{i}")
        yield f"{name}{i}"


async def _all(items: AsyncIterator[str]) -> list[str]:
    return [item async for item in items]


def test_streams_merge_by_timestamp_in_batches_as_the_sync_merge_does() -> None:
    rng = random.Random(11)
    stamps = sorted(rng.sample(range(50_000), 2000))
    streams: list[list[int]] = [[], [], []]
    for ts in stamps:
        streams[rng.choice([0, 0, 1, 2]) if ts < 30_000 else rng.choice([0, 1])].append(ts)

    async def batches(own: list[int]) -> AsyncIterator[MessageBatch]:
        cut = 0
        while cut < len(own):
            size = rng.randint(1, 200)
            yield _batch(own[cut : cut + size])
            cut += size

    async def run() -> list[MessageBatch]:
        return [b async for b in merged([batches(own) for own in streams], 150)]

    out = asyncio.run(run())
    assert all(0 < len(b) <= 150 for b in out)
    assert [ts for b in out for ts in b.timestamps()] == stamps


def test_read_ahead_hands_on_sources_in_order_and_errors_in_their_place() -> None:
    async def slow() -> AsyncIterator[str]:
        await asyncio.sleep(0.2)
        async for item in _source("a", 3):
            yield item

    sources: list[Callable[[], AsyncIterator[str]]] = [slow, lambda: _source("b", 2), lambda: _source("c", 0)]
    assert asyncio.run(_all(read_ahead(sources, ReadAhead(3, 2)))) == ["a0", "a1", "a2", "b0", "b1"]

    async def failing() -> list[str]:
        got: list[str] = []
        with pytest.raises(RuntimeError, match="b failed at 1"):
            async for item in read_ahead(
                [lambda: _source("a", 2), lambda: _source("b", 5, fail_at=1)], ReadAhead(2, 2)
            ):
                got.append(item)
        return got

    assert asyncio.run(failing()) == ["a0", "a1", "b0"]


def test_read_ahead_is_bounded_and_closing_it_cancels_its_tasks() -> None:
    taken: dict[str, list[str]] = {name: [] for name in "abc"}

    async def run() -> list[str]:
        items = read_ahead([lambda n=name: _source(n, 100, taken[n]) for name in "abc"], ReadAhead(2, 3))
        assert await anext(items) == "a0"
        await asyncio.sleep(0.1)
        # a: the one taken, 3 queued, 1 waiting for room; b: 3 queued, 1 waiting; c not started.
        assert len(taken["a"]) <= 5 and len(taken["b"]) <= 4 and not taken["c"]
        await items.aclose()

        done: list[str] = []

        async def endless() -> AsyncIterator[str]:
            try:
                async for item in _source("e", 10**9):
                    yield item
            finally:
                done.append("closed")

        reading = read_ahead([endless], ReadAhead(1, 2))
        assert await anext(reading) == "e0"
        await reading.aclose()
        with pytest.raises(ValueError, match="ahead and depth of 1 or more"):
            await anext(read_ahead([endless], ReadAhead(0, 1)))
        return done

    assert asyncio.run(run()) == ["closed"], "the task kept reading after the replay was closed"


def test_read_ahead_bounded_in_bytes_holds_what_fits_and_one_item_at_least() -> None:
    taken: dict[str, list[str]] = {name: [] for name in "ab"}
    weights = {"a": 10, "b": 40}

    async def run() -> list[str]:
        items = read_ahead(
            [lambda n=name: _source(n, 100, taken[n]) for name in "ab"],
            ReadAhead(2, 50, max_bytes=25, weigh=lambda item: weights[item[0]]),
        )
        assert await anext(items) == "a0"
        await asyncio.sleep(0.1)
        # a: a1 and a2 fit in 25 bytes, a3 waits for room; b: b0 although it weighs 40, b1 waits.
        assert len(taken["a"]) <= 4 and len(taken["b"]) <= 2
        got = [await anext(items) for _ in range(5)]
        await items.aclose()
        return got

    assert asyncio.run(run()) == ["a1", "a2", "a3", "a4", "a5"]

"""A replay's reads of one rank (a generation of a shard) up to its fence, and the merge of its streams.

A rank of one stream is read call by call; a rank of several is read in
answers that go on from stream to stream (the plan in
:mod:`mqds.client.core.rank_read`) and merged by time a batch at a time
(:func:`mqds.client.core.merge.cut`). The client calls :func:`read_rank`,
which needs only the client's ``first_batch`` and ``next`` (:class:`AsyncReads`).

Every read goes to any replica that has applied up to the fence
(``stale_ok``): up to it every replica answers the same, so no read-index
round is needed per call. ``client/generate_sync.py`` writes the synchronous
client's ``reads.py`` from this file.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from mqds.client.batch import MessageBatch, NextResult
from mqds.client.core import operations as ops
from mqds.client.core.merge import Rest, cut, runs
from mqds.client.core.rank_read import RankCalls
from mqds.client.core.stream_reads import RankRead
from mqds.client.model import Iterator as StreamIterator
from mqds.client.model import Stream
from mqds.protocol.errors import GenerationDroppedError


# The client imports this module: it names what it calls of the client (first_batch and next), not the client.
class AsyncReads(Protocol):
    """The reads of the client a replay makes."""

    async def first_batch(
        self,
        stream: Stream,
        topic_filter: str,
        start_time_us: int = 0,
        batch_size: int = 100,
        *,
        stale_ok: bool = False,
        timeout_s: float | None = None,
        fence_us: int | None = None,
        then: Sequence[Stream] = (),
    ) -> NextResult: ...

    async def next(
        self,
        iterator: StreamIterator,
        batch_size: int = 100,
        *,
        stale_ok: bool = False,
        timeout_s: float | None = None,
        fence_us: int | None = None,
    ) -> NextResult: ...


async def read_rank(client: AsyncReads, read: RankRead, streams: Sequence[Stream]) -> AsyncIterator[MessageBatch]:
    """The rank's messages up to the fence, in time order, in batches of at most ``read.batch_size``."""
    if len(streams) == 1:
        source = _stream(client, read, streams[0])
    else:
        source = merged_from(await rank_sources(client, read, streams), read.batch_size)
    async for batch in source:
        yield batch


async def _stream(client: AsyncReads, read: RankRead, stream: Stream) -> AsyncIterator[MessageBatch]:
    try:
        result = await client.first_batch(
            stream, read.topic_filter, read.start_time_us, read.batch_size, stale_ok=True, fence_us=read.fence_us
        )
    except GenerationDroppedError as err:
        read.dropped([stream], err)
        return
    if result.messages:
        yield result.messages
    if not ops.stream_exhausted(result):
        async for batch in _read_on(client, read, stream, result.iterator):
            yield batch


async def _read_on(
    client: AsyncReads, read: RankRead, stream: Stream, position: StreamIterator
) -> AsyncIterator[MessageBatch]:
    """The rest of ``stream`` from ``position`` up to the fence, batch by batch."""
    try:
        while True:
            result = await client.next(position, read.batch_size, stale_ok=True, fence_us=read.fence_us)
            if result.messages:
                yield result.messages
            if ops.stream_exhausted(result):
                return
            position = result.iterator
    except GenerationDroppedError as err:
        read.dropped([stream], err)  # and the stream ends here


async def _run_done() -> AsyncIterator[MessageBatch]:
    """The source of a run of an answer: nothing after it."""
    return
    yield  # a generator with nothing in it


async def rank_sources(
    client: AsyncReads, read: RankRead, streams: Sequence[Stream]
) -> list[tuple[AsyncIterator[MessageBatch], Rest]]:
    """The merge's sources for a rank of several streams, read in few calls: each answer's runs, and the streams
    an answer stopped inside, read on by their iterators."""
    calls = RankCalls(streams)
    live: list[tuple[AsyncIterator[MessageBatch], Rest]] = []
    while (call := calls.next_call()) is not None:
        first, then = call
        try:
            result = await client.first_batch(
                first,
                read.topic_filter,
                read.start_time_us,
                read.batch_size,
                stale_ok=True,
                fence_us=read.fence_us,
                then=then,
            )
        except GenerationDroppedError as err:
            read.dropped(calls.remaining(), err)  # none of them can be read
            break
        live += [(_run_done(), rest) for rest in runs(result.messages)]
        if (stopped := calls.answered(result)) is not None:
            source = _read_on(client, read, stopped, result.iterator)
            if (rest := await next_rest(source)) is not None:
                live.append((source, rest))
    return live


async def merged(sources: list[AsyncIterator[MessageBatch]], batch_size: int) -> AsyncIterator[MessageBatch]:
    """The batches of several streams of one rank merged by timestamp, re-cut into ``batch_size`` batches."""
    if len(sources) == 1:
        async for batch in sources[0]:
            yield batch
        return
    live = [(source, rest) for source in sources if (rest := await next_rest(source)) is not None]
    async for batch in merged_from(live, batch_size):
        yield batch


async def merged_from(
    live: list[tuple[AsyncIterator[MessageBatch], Rest]], batch_size: int
) -> AsyncIterator[MessageBatch]:
    """:func:`merged` of sources whose first rests were taken already."""
    while live:
        for batch in cut([rest for _, rest in live], batch_size):
            yield batch
        live = [
            (source, rest) for source, head in live if (rest := head if head else await next_rest(source)) is not None
        ]


async def next_rest(source: AsyncIterator[MessageBatch]) -> Rest | None:
    """The next non-empty batch of ``source`` as a merge's rest, or None when it has ended."""
    async for batch in source:
        if batch:
            return Rest(batch)
    return None

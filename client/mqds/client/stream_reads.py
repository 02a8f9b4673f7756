"""A replay's reads of one rank (a generation of a shard) up to its fence, for the sync and the asyncio client.

A rank of one stream is read call by call; a rank of several is read in
answers that go on from stream to stream and merged by time (the plan in
:mod:`mqds.client.rank_read`, the merge in :mod:`mqds.client.merge`). The
sync functions and their asyncio twins (``*_aio``) stand side by side so
they change together; the clients call :func:`read_rank` and
:func:`read_rank_aio`, which only need the client's ``first_batch`` and
``next``.

Every read goes to any replica that has applied up to the fence
(``stale_ok``): up to it every replica answers the same, so no read-index
round is needed per call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from mqds.client import operations as ops
from mqds.client import replay, replay_aio
from mqds.client.batch import MessageBatch, NextResult
from mqds.client.merge import Rest, runs
from mqds.client.model import Iterator as StreamIterator
from mqds.client.model import Stream
from mqds.client.rank_read import RankCalls
from mqds.protocol.errors import GenerationDroppedError


# The clients import this module: it names what it calls of them (their first_batch and next), not them.
class SyncReads(Protocol):
    """The reads of :class:`mqds.client.Client` a replay makes."""

    def first_batch(
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

    def next(
        self,
        iterator: StreamIterator,
        batch_size: int = 100,
        *,
        stale_ok: bool = False,
        timeout_s: float | None = None,
        fence_us: int | None = None,
    ) -> NextResult: ...


class AsyncReads(Protocol):
    """The reads of :class:`mqds.client.aio.Client` a replay makes."""

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


@dataclass(frozen=True)
class RankRead:
    """What a replay reads of each stream of a rank, and what it does when the generation is dropped."""

    topic_filter: str
    start_time_us: int
    batch_size: int
    fence_us: int
    on_dropped: Callable[[Stream], None] | None
    """Handed each stream a dropped generation leaves unread; None: the ``GenerationDroppedError`` is raised."""

    def dropped(self, streams: Sequence[Stream], error: GenerationDroppedError) -> None:
        """The generation is gone: hand ``streams`` to ``on_dropped``, or raise ``error`` without it."""
        if self.on_dropped is None:
            raise error
        for stream in streams:
            self.on_dropped(stream)


_RUN_DONE: Iterator[MessageBatch] = iter(())
"""The source of a run of an answer: nothing after it."""


def read_rank(client: SyncReads, read: RankRead, streams: Sequence[Stream]) -> Iterator[MessageBatch]:
    """The rank's messages up to the fence, in time order, in batches of at most ``read.batch_size``."""
    if len(streams) == 1:
        yield from _stream(client, read, streams[0])
    else:
        yield from replay.merged_from(rank_sources(client, read, streams), read.batch_size)


def _stream(client: SyncReads, read: RankRead, stream: Stream) -> Iterator[MessageBatch]:
    try:
        result = client.first_batch(
            stream, read.topic_filter, read.start_time_us, read.batch_size, stale_ok=True, fence_us=read.fence_us
        )
    except GenerationDroppedError as err:
        read.dropped([stream], err)
        return
    if result.messages:
        yield result.messages
    if not ops.stream_exhausted(result):
        yield from _read_on(client, read, stream, result.iterator)


def _read_on(client: SyncReads, read: RankRead, stream: Stream, position: StreamIterator) -> Iterator[MessageBatch]:
    """The rest of ``stream`` from ``position`` up to the fence, batch by batch."""
    try:
        while True:
            result = client.next(position, read.batch_size, stale_ok=True, fence_us=read.fence_us)
            if result.messages:
                yield result.messages
            if ops.stream_exhausted(result):
                return
            position = result.iterator
    except GenerationDroppedError as err:
        read.dropped([stream], err)  # and the stream ends here


def rank_sources(
    client: SyncReads, read: RankRead, streams: Sequence[Stream]
) -> list[tuple[Iterator[MessageBatch], Rest]]:
    """The merge's sources for a rank of several streams, read in few calls: each answer's runs, and the streams
    an answer stopped inside, read on by their iterators."""
    calls = RankCalls(streams)
    live: list[tuple[Iterator[MessageBatch], Rest]] = []
    while (call := calls.next_call()) is not None:
        first, then = call
        try:
            result = client.first_batch(
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
        live += [(_RUN_DONE, rest) for rest in runs(result.messages)]
        if (stopped := calls.answered(result)) is not None:
            source = _read_on(client, read, stopped, result.iterator)
            if (rest := replay.next_rest(source)) is not None:
                live.append((source, rest))
    return live


async def read_rank_aio(client: AsyncReads, read: RankRead, streams: Sequence[Stream]) -> AsyncIterator[MessageBatch]:
    """:func:`read_rank`'s twin."""
    if len(streams) == 1:
        source = _stream_aio(client, read, streams[0])
    else:
        source = replay_aio.merged_from(await rank_sources_aio(client, read, streams), read.batch_size)
    async for batch in source:
        yield batch


async def _stream_aio(client: AsyncReads, read: RankRead, stream: Stream) -> AsyncIterator[MessageBatch]:
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
        async for batch in _read_on_aio(client, read, stream, result.iterator):
            yield batch


async def _read_on_aio(
    client: AsyncReads, read: RankRead, stream: Stream, position: StreamIterator
) -> AsyncIterator[MessageBatch]:
    try:
        while True:
            result = await client.next(position, read.batch_size, stale_ok=True, fence_us=read.fence_us)
            if result.messages:
                yield result.messages
            if ops.stream_exhausted(result):
                return
            position = result.iterator
    except GenerationDroppedError as err:
        read.dropped([stream], err)


async def _run_done_aio() -> AsyncIterator[MessageBatch]:
    return
    yield  # an async generator with nothing in it


async def rank_sources_aio(
    client: AsyncReads, read: RankRead, streams: Sequence[Stream]
) -> list[tuple[AsyncIterator[MessageBatch], Rest]]:
    """:func:`rank_sources`'s twin."""
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
            read.dropped(calls.remaining(), err)
            break
        live += [(_run_done_aio(), rest) for rest in runs(result.messages)]
        if (stopped := calls.answered(result)) is not None:
            source = _read_on_aio(client, read, stopped, result.iterator)
            if (rest := await replay_aio.next_rest(source)) is not None:
                live.append((source, rest))
    return live

"""Replay's read path for the asyncio client: rank groups read ahead in tasks, streams merged a batch at a time.

The asyncio twin of ``replay.py``: up to ``ahead`` rank groups (shards, or
generations of one) are read at once, each by a task that keeps at most
``depth`` batches waiting in its queue (and with ``max_bytes``, batches
weighing at most that much together, one at least), while the caller takes
them in rank order; a group's streams are merged with the same
batch-at-a-time step (``merge.cut``). A group's error is raised where the
caller reaches it; closing the iterator early cancels the tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TypeVar

from mqds.client.batch import MessageBatch
from mqds.client.merge import Rest, cut

T = TypeVar("T")

_END = object()


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Room:
    """The bytes a source's task holds for the caller, at most ``max_bytes`` (one item at least)."""

    def __init__(self, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes
        self.held = 0
        self.changed = asyncio.Condition()

    async def reserve(self, weight: int) -> None:
        if self.max_bytes is None or not weight:
            return
        limit = self.max_bytes
        async with self.changed:
            await self.changed.wait_for(lambda: not self.held or self.held + weight <= limit)
            self.held += weight

    async def release(self, weight: int) -> None:
        if self.max_bytes is None or not weight:
            return
        async with self.changed:
            self.held -= weight
            self.changed.notify()


async def _fill(
    source: Callable[[], AsyncIterator[T]],
    out: asyncio.Queue[tuple[object, int]],
    room: _Room,
    weigh: Callable[[T], int] | None,
) -> None:
    try:
        async for item in source():
            weight = 0 if weigh is None else weigh(item)
            await room.reserve(weight)
            await out.put((item, weight))
        await out.put((_END, 0))
    except asyncio.CancelledError:
        raise
    except BaseException as err:  # handed to the caller, raised where it takes this source's items
        await out.put((_Failed(err), 0))


async def read_ahead(
    sources: Iterable[Callable[[], AsyncIterator[T]]],
    ahead: int,
    depth: int,
    max_bytes: int | None = None,
    weigh: Callable[[T], int] | None = None,
) -> AsyncIterator[T]:
    """Every item of every source, source after source, with up to ``ahead`` sources read at once.

    Each source's task keeps at most ``depth`` items waiting and, with
    ``max_bytes`` and ``weigh``, items weighing at most ``max_bytes`` together.
    """
    if ahead < 1 or depth < 1:
        raise ValueError(f"read-ahead needs ahead and depth of 1 or more, got {ahead} and {depth}")
    pending = iter(sources)
    running: deque[tuple[asyncio.Task[None], asyncio.Queue[tuple[object, int]], _Room]] = deque()

    def start(source: Callable[[], AsyncIterator[T]]) -> None:
        out: asyncio.Queue[tuple[object, int]] = asyncio.Queue(maxsize=depth)
        room = _Room(max_bytes)
        running.append((asyncio.ensure_future(_fill(source, out, room, weigh)), out, room))

    for first in itertools.islice(pending, ahead):
        start(first)
    try:
        while running:
            _, out, room = running[0]
            while True:
                item, weight = await out.get()
                if item is _END:
                    break
                await room.release(weight)
                if isinstance(item, _Failed):
                    raise item.error
                yield item  # type: ignore[misc]  # not a marker: one of the source's items
            running.popleft()
            following = next(pending, None)
            if following is not None:
                start(following)
    finally:
        for task, _, _ in running:
            task.cancel()
        for task, _, _ in running:
            with contextlib.suppress(BaseException):
                await task


async def merged(sources: list[AsyncIterator[MessageBatch]], batch_size: int) -> AsyncIterator[MessageBatch]:
    """The batches of several streams of one rank merged by timestamp, re-cut (``replay.merged``'s twin)."""
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
    """``replay.merged_from``'s twin: sources whose first rests were taken already."""
    while live:
        for batch in cut([rest for _, rest in live], batch_size):
            yield batch
        live = [
            (source, rest) for source, head in live if (rest := head if head else await next_rest(source)) is not None
        ]


async def next_rest(source: AsyncIterator[MessageBatch]) -> Rest | None:
    async for batch in source:
        if batch:
            return Rest(batch)
    return None

"""Replay's read-ahead for the asyncio driver: rank groups read ahead in tasks, handed on in rank order.

The asyncio twin of the synchronous driver's ``replay.py``: up to
``ahead`` rank groups (shards, or generations of one) are read at once,
each by a task that keeps at most ``depth`` batches waiting in its queue
(and with ``max_bytes``, batches weighing at most that much together, one
at least: :class:`~mqds.client.core.stream_reads.ReadAhead`), while the
caller takes them in rank order (a group's streams are merged by
``reads.py``). A group's error is raised where the caller reaches it;
closing the iterator early cancels the tasks."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TypeVar

from mqds.client.core.stream_reads import ReadAhead

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
    bounds: ReadAhead[T],
) -> None:
    try:
        async for item in source():
            weight = bounds.weight(item)
            await room.reserve(weight)
            await out.put((item, weight))
        await out.put((_END, 0))
    except asyncio.CancelledError:
        raise
    except BaseException as err:  # handed to the caller, raised where it takes this source's items
        await out.put((_Failed(err), 0))


async def _take(out: asyncio.Queue[tuple[object, int]], room: _Room) -> object:
    """A source's next item (or ``_END``), its room given back; the source's error, raised."""
    item, weight = await out.get()
    if item is not _END:
        await room.release(weight)
    if isinstance(item, _Failed):
        raise item.error
    return item


async def read_ahead(sources: Iterable[Callable[[], AsyncIterator[T]]], bounds: ReadAhead[T]) -> AsyncIterator[T]:
    """Every item of every source, source after source, each source read ahead by a task of its own within
    ``bounds``; a source's error is raised where the caller reaches it."""
    pending = iter(sources)
    running: deque[tuple[asyncio.Task[None], asyncio.Queue[tuple[object, int]], _Room]] = deque()

    def start(source: Callable[[], AsyncIterator[T]]) -> None:
        out: asyncio.Queue[tuple[object, int]] = asyncio.Queue(maxsize=bounds.depth)
        room = _Room(bounds.max_bytes)
        running.append((asyncio.ensure_future(_fill(source, out, room, bounds)), out, room))

    for first in itertools.islice(pending, bounds.ahead):
        start(first)
    try:
        while running:
            _, out, room = running[0]
            while (item := await _take(out, room)) is not _END:
                yield item  # type: ignore[misc]  # not a marker: one of the source's items
            running.popleft()
            if (following := next(pending, None)) is not None:
                start(following)
    finally:
        for task, _, _ in running:
            task.cancel()
        for task, _, _ in running:
            with contextlib.suppress(BaseException):
                await task

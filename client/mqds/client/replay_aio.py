"""Replay's read path for the asyncio client: rank groups read ahead in tasks, streams merged a batch at a time.

The asyncio twin of ``replay.py``: up to ``ahead`` rank groups (shards, or
generations of one) are read at once, each by a task that keeps at most
``depth`` batches waiting in its queue, while the caller takes them in rank
order; a group's streams are merged with the same batch-at-a-time step
(``merge.cut``). A group's error is raised where the caller
reaches it; closing the iterator early cancels the tasks.
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


async def _fill(source: Callable[[], AsyncIterator[T]], out: asyncio.Queue[object]) -> None:
    try:
        async for item in source():
            await out.put(item)
        await out.put(_END)
    except asyncio.CancelledError:
        raise
    except BaseException as err:  # handed to the caller, raised where it takes this source's items
        await out.put(_Failed(err))


async def read_ahead(sources: Iterable[Callable[[], AsyncIterator[T]]], ahead: int, depth: int) -> AsyncIterator[T]:
    """Every item of every source, source after source, with up to ``ahead`` sources read at once."""
    if ahead < 1 or depth < 1:
        raise ValueError(f"read-ahead needs ahead and depth of 1 or more, got {ahead} and {depth}")
    pending = iter(sources)
    running: deque[tuple[asyncio.Task[None], asyncio.Queue[object]]] = deque()

    def start(source: Callable[[], AsyncIterator[T]]) -> None:
        out: asyncio.Queue[object] = asyncio.Queue(maxsize=depth)
        running.append((asyncio.ensure_future(_fill(source, out)), out))

    for first in itertools.islice(pending, ahead):
        start(first)
    try:
        while running:
            _, out = running[0]
            while (item := await out.get()) is not _END:
                if isinstance(item, _Failed):
                    raise item.error
                yield item  # type: ignore[misc]  # not a marker: one of the source's items
            running.popleft()
            following = next(pending, None)
            if following is not None:
                start(following)
    finally:
        for task, _ in running:
            task.cancel()
        for task, _ in running:
            with contextlib.suppress(BaseException):
                await task


async def merged(sources: list[AsyncIterator[MessageBatch]], batch_size: int) -> AsyncIterator[MessageBatch]:
    """The batches of several streams of one rank merged by timestamp, re-cut (``replay.merged``'s twin)."""
    if len(sources) == 1:
        async for batch in sources[0]:
            yield batch
        return
    live = [(source, rest) for source in sources if (rest := await _next_rest(source)) is not None]
    while live:
        for batch in cut([rest for _, rest in live], batch_size):
            yield batch
        live = [
            (source, rest) for source, head in live if (rest := head if head else await _next_rest(source)) is not None
        ]


async def _next_rest(source: AsyncIterator[MessageBatch]) -> Rest | None:
    async for batch in source:
        if batch:
            return Rest(batch)
    return None

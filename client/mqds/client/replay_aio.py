"""Replay's read path for the asyncio client: rank groups read ahead in tasks, streams merged a batch at a time.

The asyncio twin of ``replay.py``: up to ``ahead`` rank groups (shards, or
generations of one) are read at once, each by a task that keeps at most
``depth`` batches waiting in its queue, while the caller takes them in rank
order; a group's streams are merged with the same batch-at-a-time step
(``replay.cut_at_horizon``). A group's error is raised where the caller
reaches it; closing the iterator early cancels the tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar

from mqds.client.batch import MessageBatch
from mqds.client.replay import cut_at_horizon, rebatch

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
    heads: list[tuple[AsyncIterator[MessageBatch], list[Any]]] = [(source, []) for source in sources]
    while True:
        heads = [(source, items or await _next_items(source)) for source, items in heads]
        heads = [(source, items) for source, items in heads if items]
        if not heads:
            return
        out, rests = cut_at_horizon([items for _, items in heads])
        heads = [(source, rest) for (source, _), rest in zip(heads, rests, strict=True)]
        for batch in rebatch(out, batch_size):
            yield batch


async def _next_items(source: AsyncIterator[MessageBatch]) -> list[Any]:
    async for batch in source:
        if batch:
            return list(batch.wire)
    return []

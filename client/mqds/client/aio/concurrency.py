"""How the asyncio driver waits, for the modules written once (``backup``): worker threads and tasks.

The synchronous driver's ``concurrency`` module has the same functions with
threads; the code generated from this driver's modules calls either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


async def to_thread(fn: Callable[..., T], /, *args: Any) -> T:
    """``fn(*args)`` in a worker thread (a file read or written), so the event loop goes on meanwhile."""
    return await asyncio.to_thread(fn, *args)


async def sleep(seconds: float) -> None:
    """Pause this task (a backoff between rounds of the nodes)."""
    await asyncio.sleep(seconds)


async def checkpoint() -> None:
    """Where a job may stop because another failed: a task is cancelled at any await, so nothing to do."""


async def in_order(jobs: Sequence[Callable[[], Awaitable[T]]], parallel: int) -> list[T]:
    """Run ``jobs`` as tasks, at most ``parallel`` at a time; their results in order.

    The first failure cancels the others (and waits for them to end), then is raised.
    """
    room = asyncio.Semaphore(max(1, parallel))

    async def one(job: Callable[[], Awaitable[T]]) -> T:
        async with room:
            return await job()

    tasks = [asyncio.ensure_future(one(job)) for job in jobs]
    try:
        return [await task for task in tasks]
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise

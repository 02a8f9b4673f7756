"""How the synchronous driver waits, for the modules written once (``backup``): the caller's thread and a pool.

The asyncio driver's ``concurrency`` module has the same functions with
tasks; the code generated from its modules calls these.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any, TypeVar

T = TypeVar("T")

_STOP: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("mqds_stop", default=None)


class Stopped(Exception):
    """Another job of the same :func:`in_order` failed: this one stops at its next :func:`checkpoint`."""


def to_thread(fn: Callable[..., T], /, *args: Any) -> T:
    """``fn(*args)``, here: the caller's thread is the one that waits."""
    return fn(*args)


def sleep(seconds: float) -> None:
    """Pause this thread (a backoff between rounds of the nodes)."""
    time.sleep(seconds)


def checkpoint() -> None:
    """Raise :class:`Stopped` if another job of this job's :func:`in_order` failed (a thread cannot be cancelled)."""
    stop = _STOP.get()
    if stop is not None and stop.is_set():
        raise Stopped


def in_order(jobs: Sequence[Callable[[], T]], parallel: int) -> list[T]:
    """Run ``jobs`` in a pool of ``parallel`` threads; their results in order.

    The first failure stops the others at their next :func:`checkpoint` (those
    not started are cancelled), waits for them to end, then is raised.
    """
    stop = threading.Event()

    def run(job: Callable[[], T]) -> T:
        _STOP.set(stop)
        return job()

    with futures.ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="mqds-jobs") as pool:
        submitted = [pool.submit(contextvars.copy_context().run, run, job) for job in jobs]
        try:
            return [job.result() for job in submitted]
        except BaseException:
            stop.set()
            for job in submitted:
                job.cancel()
            raise

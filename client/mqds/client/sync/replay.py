"""Replay's read path: streams read ahead in threads, handed on in rank order as batches.

A replay reads stream after stream; each ``Next`` waits for the node, then
the caller handles the batch, then the next ``Next`` goes out. Reading ahead
overlaps the two: up to ``ahead`` rank groups (shards, or generations of one)
are read at once, each by a thread that keeps at most ``depth`` batches
waiting, while the caller takes them in rank order. Shards led by different
nodes are then read by those nodes at once, and the caller's own work on a
batch hides the next ``Next``'s round trip.

Memory stays bounded: a thread keeps at most ``depth`` items, and with
``max_bytes`` only as many as weigh at most that much together (one at
least), so a group read ahead holds ``max_bytes`` and the batch being read.
Bounded in bytes, a group of small batches can be read far ahead, which
matters: the groups are taken one after another, and a group whose thread
stopped after a few batches was read call by call once the caller reached it.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from mqds.client.core.stream_reads import ReadAhead

T = TypeVar("T")


# How long a reader thread waits for room before it checks whether the replay was abandoned.
_PUT_POLL_S = 0.1


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


class _Reader(Generic[T]):
    """One source read in a thread into a bounded queue, ending with ``_END`` or a ``_Failed``.

    The queue holds (item, weight) pairs; with ``max_bytes``, the thread waits
    while what it holds weighs that much (``take`` gives the weight back).
    """

    def __init__(self, source: Callable[[], Iterator[T]], bounds: ReadAhead[T], stop: threading.Event) -> None:
        self.queue: queue.Queue[tuple[object, int]] = queue.Queue(maxsize=bounds.depth)
        self._stop = stop
        self._bounds = bounds
        self._held = 0
        self._room = threading.Condition()
        threading.Thread(target=self._run, args=(source,), name="mqds-replay-reader", daemon=True).start()

    def take(self) -> object:
        """The next item of the source (or ``_END``), waiting for it; the source's error, raised."""
        item, weight = self.queue.get()
        if weight:
            with self._room:
                self._held -= weight
                self._room.notify()
        if isinstance(item, _Failed):
            raise item.error
        return item

    def _run(self, source: Callable[[], Iterator[T]]) -> None:
        try:
            items = source()
            try:
                for item in items:
                    if not self._put(item, self._bounds.weight(item)):
                        return
            finally:
                close = getattr(items, "close", None)
                if close is not None:
                    close()  # a generator source ends its reads here, not when collected
            self._put(_END)
        except BaseException as err:  # handed to the caller, raised where it takes this source's items
            self._put(_Failed(err))

    def _put(self, item: object, weight: int = 0) -> bool:
        if (max_bytes := self._bounds.max_bytes) is not None and weight:
            with self._room:
                while self._held and self._held + weight > max_bytes:
                    if self._stop.is_set():
                        return False
                    self._room.wait(_PUT_POLL_S)
                self._held += weight
        while not self._stop.is_set():
            try:
                self.queue.put((item, weight), timeout=_PUT_POLL_S)
                return True
            except queue.Full:
                continue
        return False


def read_ahead(sources: Iterable[Callable[[], Iterator[T]]], bounds: ReadAhead[T]) -> Iterator[T]:
    """Every item of every source, source after source, each source read ahead in a thread of its own
    within ``bounds``.

    A source's error is raised when the caller reaches that source (the
    items before it are all handed on first). Closing the iterator early
    stops the readers: each ends after its current call.
    """
    stop = threading.Event()
    pending = iter(sources)
    running: deque[_Reader[T]] = deque(_Reader(s, bounds, stop) for s in itertools.islice(pending, bounds.ahead))
    try:
        while running:
            reader = running[0]
            while (item := reader.take()) is not _END:
                yield item  # type: ignore[misc]  # not a marker: one of the source's items
            running.popleft()
            if (source := next(pending, None)) is not None:
                running.append(_Reader(source, bounds, stop))
    finally:
        stop.set()

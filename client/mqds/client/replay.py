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
from operator import attrgetter
from typing import Generic, TypeVar

from mqds.client.batch import MessageBatch
from mqds.client.merge import Rest, cut

T = TypeVar("T")

GROUP_DEPTH = 64
"""Batches a replay keeps ready ahead of the caller, per rank group read ahead (at most)."""
GROUP_BYTES = 16 * 1024 * 1024
"""Bytes of answers a replay keeps ready ahead of the caller, per rank group read ahead (at most, one batch
more if a single batch is larger): with ``read_ahead`` 4, 64 MiB and the batches being read. Before, four
batches a group: read call by call once the caller reached it; groups of 61,000 messages in eleven
streams replayed 388,000-438,000 msg/s against 531,000-543,000 (docs/performance.md)."""
WEIGH_BATCH: Callable[[MessageBatch], int] = attrgetter("nbytes")

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

    def __init__(
        self,
        source: Callable[[], Iterator[T]],
        depth: int,
        stop: threading.Event,
        max_bytes: int | None = None,
        weigh: Callable[[T], int] | None = None,
    ) -> None:
        self.queue: queue.Queue[tuple[object, int]] = queue.Queue(maxsize=depth)
        self._stop = stop
        self._max_bytes = max_bytes
        self._weigh = weigh
        self._held = 0
        self._room = threading.Condition()
        threading.Thread(target=self._run, args=(source,), name="mqds-replay-reader", daemon=True).start()

    def take(self) -> object:
        """The next item (or marker) of the source, waiting for it."""
        item, weight = self.queue.get()
        if weight:
            with self._room:
                self._held -= weight
                self._room.notify()
        return item

    def _run(self, source: Callable[[], Iterator[T]]) -> None:
        try:
            items = source()
            try:
                for item in items:
                    if not self._put(item, 0 if self._weigh is None else self._weigh(item)):
                        return
            finally:
                close = getattr(items, "close", None)
                if close is not None:
                    close()  # a generator source ends its reads here, not when collected
            self._put(_END)
        except BaseException as err:  # handed to the caller, raised where it takes this source's items
            self._put(_Failed(err))

    def _put(self, item: object, weight: int = 0) -> bool:
        if self._max_bytes is not None and weight:
            with self._room:
                while self._held and self._held + weight > self._max_bytes:
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


def read_ahead(
    sources: Iterable[Callable[[], Iterator[T]]],
    ahead: int,
    depth: int,
    max_bytes: int | None = None,
    weigh: Callable[[T], int] | None = None,
) -> Iterator[T]:
    """Every item of every source, source after source, with up to ``ahead`` sources read at once.

    Each source's thread keeps at most ``depth`` items waiting and, with
    ``max_bytes`` and ``weigh``, items weighing at most ``max_bytes`` together.

    A source's error is raised when the caller reaches that source (the
    items before it are all handed on first). Closing the iterator early
    stops the readers: each ends after its current call.
    """
    if ahead < 1 or depth < 1:
        raise ValueError(f"read-ahead needs ahead and depth of 1 or more, got {ahead} and {depth}")
    stop = threading.Event()
    pending = iter(sources)
    running: deque[_Reader[T]] = deque(
        _Reader(s, depth, stop, max_bytes, weigh) for s in itertools.islice(pending, ahead)
    )
    try:
        while running:
            reader = running[0]
            while (item := reader.take()) is not _END:
                if isinstance(item, _Failed):
                    raise item.error
                yield item  # type: ignore[misc]  # not a marker: one of the source's items
            running.popleft()
            source = next(pending, None)
            if source is not None:
                running.append(_Reader(source, depth, stop, max_bytes, weigh))
    finally:
        stop.set()


def merged(sources: list[Iterator[MessageBatch]], batch_size: int) -> Iterator[MessageBatch]:
    """The batches of several streams of one rank, merged by timestamp (each sender's order kept), re-cut.

    A rank with one stream skips this. The merge goes a batch at a time
    (:func:`mqds.client.merge.cut`); each source holds one batch at a time.
    """
    if len(sources) == 1:
        yield from sources[0]
        return
    live = [(source, rest) for source in sources if (rest := next_rest(source)) is not None]
    yield from merged_from(live, batch_size)


def merged_from(live: list[tuple[Iterator[MessageBatch], Rest]], batch_size: int) -> Iterator[MessageBatch]:
    """:func:`merged` of sources whose first rests were taken already: each (source, non-empty rest of its batch).

    A source may have nothing more after its rest (``iter(())``): a run of
    an answer that read several streams (:func:`mqds.client.merge.runs`).
    """
    while live:
        yield from cut([rest for _, rest in live], batch_size)
        # An exhausted source leaves.
        live = [(source, rest) for source, head in live if (rest := head if head else next_rest(source)) is not None]


def next_rest(source: Iterator[MessageBatch]) -> Rest | None:
    """The source's next non-empty batch; None once it is exhausted."""
    for batch in source:
        if batch:
            return Rest(batch)
    return None

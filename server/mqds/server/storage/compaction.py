"""Giving back the disk that deletes free: compactions of the key ranges a delete step left tombstones in.

RocksDB keeps deleted keys (and what a range deletion covers) on disk until a
compaction of their files drops them, and on a shard that takes no more
writes in that generation none would come: a closed generation whose streams
were deleted kept its whole size. So each delete or retention step that
deleted something records the key range it touched in that generation's
column family, and the node's one compaction thread (``Engine.compactions``)
compacts it soon after, outside the shard's lock (writes and reads go on).
Requests for the same generation made meanwhile are merged into one range.

Per-message tombstones elsewhere (expired sessions and retained messages in
the metadata family) are left to RocksDB's deletion collector
(``Engine.cf_options``), which marks a file with many of them for compaction.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent import futures

log = logging.getLogger(__name__)


class CompactionThread:
    """The one thread of a node that runs range compactions, one after another (``Engine.compactions``)."""

    def __init__(self) -> None:
        self._pool: futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._pool is None:
                self._pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="compact")
            self._pool.submit(job)


class PendingRanges:
    """The key ranges of one shard waiting for a compaction, by generation; merged while they wait."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranges: dict[int, tuple[bytes, bytes]] = {}

    def add(self, generation: int, begin: bytes, end: bytes) -> bool:
        """Record a range; True when nothing was waiting (the caller schedules a compaction)."""
        with self._lock:
            was_empty = not self._ranges
            known = self._ranges.get(generation)
            if known is not None:
                begin, end = min(begin, known[0]), max(end, known[1])
            self._ranges[generation] = (begin, end)
            return was_empty

    def take(self) -> dict[int, tuple[bytes, bytes]]:
        with self._lock:
            ranges, self._ranges = self._ranges, {}
            return ranges

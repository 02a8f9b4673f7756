"""Giving back the disk that deletes free: compactions of the key ranges a delete step left tombstones in.

RocksDB keeps deleted keys (and what a range deletion covers) on disk until a
compaction of their files drops them, and on a shard that takes no more
writes in that generation none would come: a closed generation whose streams
were deleted kept its whole size. So each delete or retention step that
deleted something records the key range it touched in that generation's
column family, and the node's one compaction thread (``Engine.compactions``)
compacts it soon after, outside the shard's lock (writes and reads go on).
Requests for the same generation made meanwhile are merged into one range.

The metadata family gets the same once what expiry removed from it
(sessions, retained messages: ``ShardDeletes.metadata_deleted``) outweighs
what it still holds: a whole compaction of the family (pending under
:data:`METADATA`), which also flushes its memtable, so RocksDB's log goes
too. A soak of short-lived clientids kept every one of their records and
tombstones on disk before (98.9 MiB after 100,000 clients whose keys were
all gone). Smaller batches of tombstones are left to RocksDB's deletion
collector (``Engine.cf_options``), which marks a file with many of them for
compaction.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent import futures

log = logging.getLogger(__name__)

METADATA = -1
"""The pending "generation" that stands for the metadata (``default``) family, compacted whole."""


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

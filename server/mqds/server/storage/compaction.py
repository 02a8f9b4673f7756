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
(sessions, retained messages: ``ShardStorage.metadata_deleted``) outweighs
what it still holds: a whole compaction of the family (pending under
:data:`METADATA`), which also flushes its memtable, so RocksDB's log goes
too. A soak of short-lived clientids kept every one of their records and
tombstones on disk before (98.9 MiB after 100,000 clients whose keys were
all gone). Smaller batches of tombstones are left to RocksDB's deletion
collector (``Engine.cf_options``), which marks a file with many of them for
compaction.

A shard holds one :class:`ShardCompactions`: what it waits for, and the
count of metadata keys deleted since its last compaction. It is given the
node's thread and two callables of the shard (the family to compact, the
metadata family's estimated keys), never the shard itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent import futures

from rocksdict import Rdict

log = logging.getLogger(__name__)

METADATA = -1
"""The pending "generation" that stands for the metadata (``default``) family, compacted whole."""
META_COMPACT_MIN_KEYS = 1_000
"""Keys expiry must have deleted from the metadata family before it is compacted (and half what is left)."""


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


class ShardCompactions:
    """The compactions one shard waits for: key ranges its delete steps touched, its metadata family after expiry."""

    def __init__(
        self,
        shard: int,
        thread: CompactionThread,
        family: Callable[[int], Rdict | None],
        metadata_keys: Callable[[], int],
        release_logs: Callable[[], None],
    ) -> None:
        """``family(number)``: the column family to compact (:data:`METADATA`: the database), taken under the
        shard's lock; None once that generation was dropped or the shard closed. ``metadata_keys()``: RocksDB's
        estimate of the metadata family's keys. ``release_logs()``: every family's memtable flushed (not
        waited for), so the write-ahead log files that held what was deleted can go."""
        self._shard = shard
        self._thread = thread
        self._family = family
        self._metadata_keys = metadata_keys
        self._release_logs = release_logs
        self.lock = threading.Lock()
        """Held while compactions run: the shard's ``close`` takes it, so it waits for one under way."""
        self._pending = PendingRanges()
        self._meta_deleted = 0
        """Keys expiry deleted from the metadata family since it was last compacted (``metadata_deleted``)."""

    def soon(self, ranges: list[tuple[int, bytes, bytes]]) -> None:
        """Have the node's compaction thread compact what a step deleted."""
        schedule = False
        for generation, begin, end in ranges:
            schedule |= self._pending.add(generation, begin, end)
        if schedule:
            self._thread.submit(self._run)

    def metadata_deleted(self, count: int) -> None:
        """Expiry deleted ``count`` keys of the metadata family: compact it once they outweigh what it holds.

        Amortised: a compaction rewrites what is live, so it waits until
        the keys deleted since the last one are at least half of RocksDB's
        estimate of the family's keys (and ``META_COMPACT_MIN_KEYS``).
        """
        self._meta_deleted += count
        if self._meta_deleted < META_COMPACT_MIN_KEYS:
            return
        live = self._metadata_keys()
        if self._meta_deleted * 2 < live:
            return
        self._meta_deleted = 0
        self.soon([(METADATA, b"", b"")])

    def _run(self) -> None:
        """On the compaction thread: compact each waiting range, outside the shard's lock (close waits)."""
        with self.lock:
            for number, (begin, end) in self._pending.take().items():
                cf = self._family(number)
                if cf is None:  # dropped meanwhile (its files are gone anyway), or the shard closed
                    continue
                try:
                    if number == METADATA:
                        cf.compact_range(None, None)
                    else:
                        cf.compact_range(begin, end)
                except Exception as err:  # the disk comes back later, with other compactions
                    log.warning("shard %d: compacting %s after deletes failed: %s", self._shard, _family(number), err)
            # A write-ahead log file goes only once every family flushed what it holds, and a shard that stopped
            # taking writes (everything deleted) never fills a memtable again: without this, its logs (up to
            # max_total_wal_size) stayed on disk after the data they held was gone.
            try:
                self._release_logs()
            except Exception as err:
                log.warning("shard %d: flushing after deletes failed: %s", self._shard, err)


def _family(number: int) -> str:
    return "the metadata family" if number == METADATA else f"generation {number}"

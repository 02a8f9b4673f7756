"""A shard's files: its size as RocksDB accounts it, the WAL synced, checkpoints, a flush, a consistent view.

A part of :class:`mqds.server.storage.shard.ShardStorage` (it inherits
:class:`ShardFiles`), which owns the database, the lock and the generations;
nothing here changes what the shard holds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rocksdict import Checkpoint, Rdict

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.server.storage import keys
from mqds.server.storage.generations import Generations


@dataclass(frozen=True)
class ShardSize:
    """A shard's size as RocksDB accounts it (SST files; memtables are not on disk yet)."""

    generation_bytes: dict[int, int]
    """SST bytes of each generation's column family, by generation number."""
    metadata_bytes: int
    """SST bytes of the metadata family (trie, generation records, dedup memory, broker state)."""
    memtable_bytes: int
    """Bytes in memtables, all families together: written, not flushed to SST files yet."""


class ShardView:
    """A shard's content at one applied index: each column family's (key, value) pairs, in order."""

    def __init__(self, applied_index: int, families: list[tuple[str, Iterator[tuple[bytes, bytes]]]]) -> None:
        self.applied_index = applied_index
        """The last log index applied to what the view holds."""
        self._families = families

    def items(self) -> Iterator[tuple[str, bytes, bytes]]:
        """Every (column family, key, value): the metadata family first, then each generation's, oldest first."""
        for name, pairs in self._families:
            for key, value in pairs:
                yield name, key, value


class ShardFiles:
    """The shard's files; the attributes below are ShardStorage's."""

    shard: int
    applied_index: int
    _lock: threading.RLock
    _db: Any
    _generations: Generations

    def estimated_keys(self, number: int) -> int:
        """RocksDB's estimate of the keys in a generation (messages and index entries); 0 if unknown."""
        with self._lock:
            gen = self._generations.by_number.get(number)
            if gen is None:
                return 0
            try:
                return int(gen.cf.property_int_value("rocksdb.estimate-num-keys") or 0)
            except Exception:  # an estimate only
                return 0

    def disk_usage(self) -> ShardSize:
        """The shard's size from RocksDB's properties: cheap (no file walk), for the metrics scrape."""

        def prop(cf: Rdict, name: str) -> int:
            try:
                return int(cf.property_int_value(name) or 0)
            except Exception:  # a figure for monitoring: unknown counts as 0
                return 0

        with self._lock:
            if self._db is None:
                return ShardSize({}, 0, 0)
            by_number = self._generations.by_number
            gens = {n: prop(g.cf, "rocksdb.total-sst-files-size") for n, g in sorted(by_number.items())}
            memtables = prop(self._db, "rocksdb.cur-size-all-mem-tables") + sum(
                prop(g.cf, "rocksdb.cur-size-all-mem-tables") for g in by_number.values()
            )
            return ShardSize(gens, prop(self._db, "rocksdb.total-sst-files-size"), memtables)

    def sync_wal(self) -> None:
        """fsync RocksDB's write-ahead log: everything applied so far survives a machine crash."""
        with self._lock:
            try:
                self._db.flush_wal(True)
            except Exception as err:
                raise errors.error(Reason.STORAGE_ERROR, f"shard {self.shard}: WAL sync failed: {err}") from err

    def checkpoint(self, path: str) -> int:
        """Write a consistent copy of the shard to ``path`` (hard links where possible); its applied index."""
        with self._lock:
            try:
                Checkpoint(self._db).create_checkpoint(path)
            except Exception as err:
                raise errors.error(Reason.STORAGE_ERROR, f"shard {self.shard}: checkpoint failed: {err}") from err
            return self.applied_index

    def flush(self, wait_s: float = 120) -> None:
        """Flush every memtable to disk and wait (bounded) for background compactions."""
        with self._lock:
            cfs = [self._db] + [gen.cf for gen in self._generations.by_number.values()]
            for cf in cfs:
                cf.flush()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            busy = sum(
                self._db.property_int_value(name) or 0
                for name in (
                    "rocksdb.num-running-compactions",
                    "rocksdb.num-running-flushes",
                    "rocksdb.compaction-pending",
                )
            )
            if not busy:
                return
            time.sleep(0.05)

    def view(self) -> ShardView:
        """The shard's whole content as it stood at one applied index, to read while it goes on changing.

        A RocksDB iterator reads the database as it was when the iterator was
        made (rocksdict's ``items()`` makes it at the call); each column
        family's is made here under the lock every write takes, so no write
        falls between them and they agree with ``applied_index``. The
        database must stay open while the view is read: hold the replica's
        reader guard (``VnodeReplica.reading``). A generation dropped
        meanwhile stays readable through its iterator, and RocksDB keeps the
        files the view reads until its iterators are gone: read it promptly.
        """
        with self._lock:
            by_number = self._generations.by_number
            cfs = [("default", self._db)] + [(keys.generation_cf(n), by_number[n].cf) for n in sorted(by_number)]
            return ShardView(self.applied_index, [(name, cf.items()) for name, cf in cfs])

    def dump(self) -> Iterator[tuple[str, bytes, bytes]]:
        """Every (column family, key, value), in a stable order: the shard's whole content (one ``view``)."""
        return self.view().items()

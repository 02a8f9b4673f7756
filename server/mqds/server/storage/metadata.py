"""A shard's metadata family as the parts that keep their state in it see it: read, scan, write.

Broker state (``sessions.py``), its expiry indexes (``expiry.py``) and the
share groups (``share_groups.py``) live in the shard's ``default`` column
family, beside the shard's own records. ``ShardStorage`` opens the database
and owns its lock and its write path; it hands each of those parts a
:class:`MetadataFamily` (the family, and its own ``write_meta``), so a part
reads and writes what it keeps without seeing the rest of the shard. Writes
still go through the shard: under its lock, with the applied log index.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from rocksdict import WriteBatch

from mqds.server.storage.engine import scan


class MetadataFamily:
    """One shard's ``default`` column family: its keys read and scanned here, its batches written by the shard."""

    def __init__(self, db: Any, handle: object, write: Callable[[WriteBatch, int | None], None]) -> None:
        self._db = db
        self.handle = handle
        """The family's handle, for ``WriteBatch.put(..., handle)``."""
        self._write = write

    def get(self, key: bytes) -> bytes | None:
        value: bytes | None = self._db.get(key)
        return value

    def scan(self, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """The family's keys starting with ``prefix``, in order, with their values (from ``start`` on, if given)."""
        return scan(self._db, prefix, start)

    def write(self, batch: WriteBatch, applied_index: int | None) -> None:
        """Write a batch of this family's changes (built with ``handle``), recording ``applied_index``."""
        self._write(batch, applied_index)

    def close(self) -> None:
        """Let go of the database and the handle (the shard closes; RocksDB stays locked while a handle lives)."""
        self._db = None
        self.handle = None

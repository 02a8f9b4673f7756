"""The deletes of a shard: delete and retention steps, what a retention check finds, compactions after them.

A part of :class:`mqds.server.storage.shard.ShardStorage` (it inherits
:class:`ShardDeletes`), which owns the database, the lock and the write path;
``deletes.py`` and ``retention.py`` decide what a step deletes, and
``compaction.py`` gives the disk back.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from rocksdict import WriteBatch

from mqds.server.storage import deletes, keys, retention
from mqds.server.storage.compaction import METADATA, PendingRanges
from mqds.server.storage.engine import Engine
from mqds.server.storage.generations import Generations
from mqds.server.storage.trie import TopicTrie

log = logging.getLogger(__name__)

META_COMPACT_MIN_KEYS = 1_000
"""Keys expiry must have deleted from the metadata family before it is compacted (and half what is left)."""


class ShardDeletes:
    """Delete and retention steps of one shard (``ShardStorage`` provides the attributes below)."""

    shard: int
    trie: TopicTrie
    last_ts: int
    _lock: threading.RLock
    _compact_lock: threading.Lock
    _pending_compactions: PendingRanges
    _meta_deleted: int
    _engine: Engine
    _db: Any

    _generations: Generations

    def _write(self, batch: WriteBatch, sync: bool, applied_index: int | None) -> None:
        raise NotImplementedError

    def delete_messages(
        self,
        spec: deletes.DeleteSpec,
        cursor: deletes.Cursor | None,
        max_keys: int,
        *,
        applied_index: int | None = None,
    ) -> deletes.StepResult:
        """One step of a delete (``deletes.py``): at most ``max_keys`` keys scanned, the matches deleted.

        ``spec.until_us`` 0: up to what is stored now (the first step fixes
        it; the result carries it for the next steps).
        """
        with self._lock:
            if not spec.until_us:
                spec = deletes.DeleteSpec(spec.topic_filter, spec.sender, spec.since_us, self.last_ts + 1)
            batch = WriteBatch(raw_mode=True)
            result = deletes.step(self.trie, self._generations.in_order(), spec, cursor, max_keys, batch)
            self._count_changes(result, batch)
            self._write(batch, False, applied_index)
        self._compact_soon(result.ranges)
        return result

    def apply_retention(
        self,
        policy: retention.Policy,
        now_us: int,
        after_us: int,
        cursor: deletes.Cursor | None,
        max_keys: int,
        *,
        applied_index: int | None = None,
    ) -> deletes.StepResult:
        """One step of a retention pass (``retention.py``): what the policy's periods ended by ``now_us``."""
        with self._lock:
            batch = WriteBatch(raw_mode=True)
            gens = self._generations.in_order()
            result = retention.step(self.trie, gens, policy, now_us, after_us, cursor, max_keys, batch)
            self._count_changes(result, batch)
            self._write(batch, False, applied_index)
        self._compact_soon(result.ranges)
        return result

    def metadata_deleted(self, count: int) -> None:
        """Expiry deleted ``count`` keys of the metadata family: compact it once they outweigh what it holds.

        Amortised: a compaction rewrites what is live, so it waits until
        the keys deleted since the last one are at least half of RocksDB's
        estimate of the family's keys (and ``META_COMPACT_MIN_KEYS``).
        Called by the apply of an expiry step (one at a time), after its write.
        """
        self._meta_deleted += count
        if self._meta_deleted < META_COMPACT_MIN_KEYS:
            return
        live = self._db.property_int_value("rocksdb.estimate-num-keys") or 0
        if self._meta_deleted * 2 < live:
            return
        self._meta_deleted = 0
        self._compact_soon([(METADATA, b"", b"")])

    def _count_changes(self, result: deletes.StepResult, batch: WriteBatch) -> None:
        """Count the step in each generation it removed keys of (``keys.changes_key``), in the step's write.

        A backup copies a closed generation again only when its count moved
        (``export.py``): closed generations take no new messages, but a delete
        or a retention pass may remove some of theirs.
        """
        meta = self._db.get_column_family_handle("default")
        for number in sorted({generation for generation, _, _ in result.ranges}):
            key = keys.changes_key(number)
            raw = self._db.get(key)
            batch.put(key, keys.u64((keys.read_u64(raw) if raw is not None else 0) + 1), meta)

    def _compact_soon(self, ranges: list[tuple[int, bytes, bytes]]) -> None:
        """Have the node's compaction thread compact what a step deleted (``compaction.py``)."""
        schedule = False
        for generation, begin, end in ranges:
            schedule |= self._pending_compactions.add(generation, begin, end)
        if schedule:
            self._engine.compactions.submit(self._compact_pending)

    def _compact_pending(self) -> None:
        """On the compaction thread: compact each waiting range, outside the shard's lock (close waits)."""
        with self._compact_lock:
            for number, (begin, end) in self._pending_compactions.take().items():
                with self._lock:
                    if self._db is None:
                        return
                    gen = self._generations.by_number.get(number)
                    cf = self._db if number == METADATA else getattr(gen, "cf", None)
                if cf is None:  # dropped meanwhile: its files are gone anyway
                    continue
                try:
                    if number == METADATA:
                        cf.compact_range(None, None)
                    else:
                        cf.compact_range(begin, end)
                except Exception as err:  # the disk comes back later, with other compactions
                    log.warning("shard %d: compacting %s after deletes failed: %s", self.shard, _family(number), err)

    def retention_due(self, policy: retention.Policy, now_us: int, after_us: int) -> tuple[list[int], bool]:
        """The closed generations the policy lets drop whole, and whether a pass may find messages to remove."""
        with self._lock:
            gens = self._generations.in_order()
            drops = [g.number for g in gens if retention.droppable(g, self.trie, policy, now_us)]
            kept = [g for g in gens if g.number not in drops]
            return drops, retention.may_have_expired(kept, self.trie, policy, now_us, after_us)


def _family(number: int) -> str:
    return "the metadata family" if number == METADATA else f"generation {number}"

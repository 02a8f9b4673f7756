"""One shard's storage: a RocksDB database cut into generations and streams.

The storage layer knows nothing of Raft or gRPC requests. Every change comes
in as a call with all its inputs (messages, the time to use, the log index it
belongs to), so replaying the same calls gives the same content on every
replica: timestamps come from ``now_us`` given by the caller, never from the
clock; trie node ids come from creation order. Each change is one RocksDB
write batch, which also records the applied log index when one is given.

``ShardStorage`` owns the database, the lock and the shard's counters, and
delegates each concept to a module of its own: ``engine.py`` (RocksDB
options shared by a node's shards), ``writes.py`` (a stored batch as one
write batch), ``dedup.py`` (exactly-once storing), ``generations.py``
(opening, adding and dropping generations), ``deletes.py`` and
``retention.py`` (what a delete or retention step deletes), ``restore.py``
(checking and writing a backup's records; ``export.py`` reads one for a
backup), ``reads.py`` (streams and scans), ``wire.py`` (messages in
protobuf wire form). The names they define that callers use are
importable from here too. The shard's files (size, WAL sync, checkpoints,
flush, a consistent view) and the steps of deletes, retention and restores
are methods here: they work on the shard's own lock, database, generations
and write path. Broker state (``sessions.py``), share groups
(``share_groups.py``) and the compactions the shard waits for
(``compaction.py``) are parts it holds, with state of their own: each is
handed what it needs (the metadata family, ``metadata.py``; callables of
the shard), never the shard itself.

See ``keys.py`` for the key layout and ``DESIGN.md`` for the why.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from rocksdict import Checkpoint, Rdict, WriteBatch

from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.server.durable import make_dirs
from mqds.server.storage import dedup as dedups
from mqds.server.storage import deletes, expiry, keys, limits, reads, restore, retention, writes
from mqds.server.storage.compaction import METADATA, ShardCompactions
from mqds.server.storage.consumers import ConsumerListing
from mqds.server.storage.dedup import DEDUP_PRUNE_PERIOD_US, DEDUP_WINDOW_US
from mqds.server.storage.deliveries import Deliveries
from mqds.server.storage.engine import Engine, EngineOptions, scan
from mqds.server.storage.generations import Generation, GenerationInfo, Generations
from mqds.server.storage.iterators import IteratorState
from mqds.server.storage.metadata import MetadataFamily
from mqds.server.storage.ordered import ordered
from mqds.server.storage.reads import ReadResult, StreamRef
from mqds.server.storage.sessions import SessionState
from mqds.server.storage.share_groups import ShareGroups
from mqds.server.storage.trie import TopicTrie
from mqds.server.wire import (
    decode_message,
    encode_messages,
    message_wire,
    repeated_field,
    shard_field,
    varint,
)
from mqds.v1 import storage_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StorePart:
    """One batch of a ``ShardStorage.store_many`` call: what ``store`` takes for one batch."""

    messages: Sequence[pb.Message]
    now_us: int
    dedup: tuple[bytes, int] | None = None
    encoded: Sequence[bytes] | None = None


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


__all__ = [
    "DEDUP_PRUNE_PERIOD_US",
    "DEDUP_WINDOW_US",
    "Engine",
    "EngineOptions",
    "GenerationInfo",
    "ReadResult",
    "ShardSize",
    "ShardStorage",
    "StorePart",
    "StreamRef",
    "decode_message",
    "encode_messages",
    "message_wire",
    "repeated_field",
    "shard_field",
    "varint",
]


class ShardStorage:
    """The storage of one shard: generations, streams, iterators."""

    def __init__(
        self,
        path: str,
        shard: int,
        engine: Engine,
        *,
        lts_threshold_top: int = 100,
        lts_threshold: int = 10,
    ) -> None:
        self.path = path
        self.shard = shard
        self._engine = engine
        self._lock = threading.RLock()
        self._generations = Generations(shard)
        self.last_ts = 0
        self.applied_index = 0
        self.part_mark: bytes | None = None
        """Set while one part of a multi-part log entry is applied (``begin_part``): its writes record it."""
        self._dedup_pruned = 0
        self.restoring = False
        """A restore began (``restore_begin``) and has not finished or been abandoned: the vnode refuses every
        other command."""
        self.restored_ts = 0
        """While ``restoring``: the largest timestamp of the records written (``restore.records_ts``), kept in the
        mark."""
        self.keys_read = 0
        """Keys read by ``next`` since the shard was opened (a cost measure)."""

        make_dirs(path)  # RocksDB syncs what it writes in the directory, not the directory's own name
        existing = Rdict.list_cf(path) if os.path.exists(os.path.join(path, "CURRENT")) else ["default"]
        cf_opts = {name: engine.cf_options() for name in existing if name != "default"}
        self._db = Rdict(path, engine.db_options(), column_families=cf_opts or None)
        self._meta_handle = self._db.get_column_family_handle("default")
        self._compactions = ShardCompactions(
            shard, engine.compactions, self._compaction_family, self._metadata_keys, self.release_logs
        )
        """The compactions this shard waits for after deletes and expiry (``compaction.py``)."""
        self.trie = self._load(lts_threshold_top, lts_threshold, existing)
        self._routes = writes.Routes(self.trie)
        self._metadata = MetadataFamily(self._db, self._meta_handle, self.write_meta)
        """The metadata family as the parts below see it (``metadata.py``): written through ``write_meta``."""
        self.sessions = SessionState(
            self._metadata, shard, functools.partial(ordered, self), deleted=self.metadata_deleted
        )
        """Client state, subscriptions, retained messages and read positions kept in this shard."""
        self.share_groups = ShareGroups(self._metadata)
        """The members of the share groups kept in this shard (shared subscriptions)."""
        self.deliveries = Deliveries(self._metadata, functools.partial(ordered, self), self._store_dead)
        """The deliveries of this shard's messages to consumers that redeliver (``Sessions.Deliver``)."""
        self.consumers = ConsumerListing(self._metadata, self.sessions.read_position, self.sessions.subscriptions)
        """This shard's sessions, read positions and share groups, listed page by page (``mqds consumers``)."""

    @property
    def _gens(self) -> dict[int, Generation]:
        """The open generations by number (``Generations.by_number``)."""
        return self._generations.by_number

    # -- opening -------------------------------------------------------------

    def _load(self, threshold_top: int, threshold: int, cf_names: list[str]) -> TopicTrie:
        db = self._db
        fmt = db.get(keys.META_FORMAT)
        if fmt is None:
            batch = WriteBatch(raw_mode=True)
            batch.put(keys.META_FORMAT, keys.u16(keys.FORMAT_VERSION), self._meta_handle)
            batch.put(keys.META_SHARD, keys.u32(self.shard), self._meta_handle)
            batch.put(keys.META_LTS, keys.u32(threshold_top) + keys.u32(threshold), self._meta_handle)
            db.write(batch, self._engine.sync_write)
        else:
            version = keys.read_u16(fmt)
            if version not in keys.READABLE_FORMATS:
                readable = " and ".join(str(v) for v in keys.READABLE_FORMATS)
                raise errors.error(
                    Reason.STORAGE_ERROR,
                    f"{self.path}: storage format version {version} is not supported by this node "
                    f"(it reads {readable})",
                )
            if version != keys.FORMAT_VERSION:
                # Version 1 had no posting lists; this node reads its keys as
                # they are and writes new ones with them, which an older node
                # would misread: mark the database as the current version.
                db.put(keys.META_FORMAT, keys.u16(keys.FORMAT_VERSION), self._engine.sync_write)
            stored_shard = keys.read_u32(db[keys.META_SHARD])
            if stored_shard != self.shard:
                raise errors.error(
                    Reason.STORAGE_ERROR, f"{self.path} holds shard {stored_shard}, not shard {self.shard}"
                )
        lts = db[keys.META_LTS]
        trie = TopicTrie(threshold_top=keys.read_u32(lts[:4]), threshold=keys.read_u32(lts[4:8]))
        for key, value in scan(db, keys.TRIE_PREFIX):
            parent, token = keys.parse_trie_edge_key(key)
            trie.restore_edge(parent, token, keys.read_u32(value))
        raw = db.get(keys.META_NEXT_NODE)
        if raw is not None:
            trie.next_node = keys.read_u32(raw)
        raw = db.get(keys.META_LAST_TS)
        self.last_ts = keys.read_u64(raw) if raw is not None else 0
        raw = db.get(keys.META_APPLIED)
        self.applied_index = keys.read_u64(raw) if raw is not None else 0
        raw = db.get(keys.META_DEDUP_PRUNED)
        self._dedup_pruned = keys.read_u64(raw) if raw is not None else 0
        raw = db.get(keys.META_RESTORING)
        self.restoring = raw is not None
        self.restored_ts = keys.read_u64(raw) if raw else 0
        self._generations.load(db, self._engine, cf_names)
        return trie

    def reload(self) -> None:
        """Read the views (generations, topic trie, counters) again from the database, as opening does.

        After a restore wrote the shard's keys (``restore.py``); thresholds come from the database.
        """
        with self._lock:
            self._generations = Generations(self.shard)
            self.trie = self._load(0, 0, Rdict.list_cf(self.path))
            self._routes = writes.Routes(self.trie)

    @staticmethod
    def _scan(cf: Rdict, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        return scan(cf, prefix)

    def close(self) -> None:
        """Close the database. Column family handles go first, or RocksDB stays locked.

        A compaction after a delete (``compaction.py``) runs to its end first.
        """
        with self._compactions.lock, self._lock:
            self._generations.by_number.clear()
            self._meta_handle = None
            self._metadata.close()
            db, self._db = self._db, None
            if db is not None:
                db.close()

    # -- writes (deterministic state transitions) -----------------------------

    def _write(self, batch: WriteBatch, sync: bool, applied_index: int | None) -> None:
        if applied_index is not None:
            batch.put(keys.META_APPLIED, keys.u64(applied_index), self._meta_handle)
        elif self.part_mark is not None:
            batch.put(keys.META_APPLIED_PART, self.part_mark, self._meta_handle)
        try:
            self._db.write(batch, self._engine.sync_write if sync else self._engine.async_write)
        except Exception as err:
            raise errors.error(Reason.STORAGE_ERROR, f"shard {self.shard}: write failed: {err}") from err
        if applied_index is not None:
            self.applied_index = applied_index

    def write_meta(self, batch: WriteBatch, applied_index: int | None) -> None:
        """Write a batch of metadata-family changes (built with ``meta_handle``).

        Not synced, like ``store``: the Raft journal holds the command (fsynced
        before anyone acknowledged it) and is replayed after a crash.
        """
        with self._lock:
            self._write(batch, False, applied_index)

    @property
    def meta_handle(self) -> object:
        """The ``default`` column family's handle, for ``WriteBatch.put(..., handle)``."""
        return self._meta_handle

    def meta_get(self, key: bytes) -> bytes | None:
        value: bytes | None = self._db.get(key)
        return value

    def meta_get_many(self, keys_: list[bytes]) -> list[bytes | None]:
        values: list[bytes | None] = self._db.get(keys_)
        return values

    def meta_scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """The ``default`` family's keys starting with ``prefix``, in order, with their values."""
        return scan(self._db, prefix)

    def initialize(self, now_us: int, *, applied_index: int | None = None) -> GenerationInfo:
        """Create generation 1 if the shard has none; return the current generation."""
        with self._lock:
            gens = self._generations
            if not gens.by_number:
                gens.create_first(
                    self._db,
                    self._engine,
                    self._meta_handle,
                    now_us,
                    self.last_ts,
                    lambda b: self._write(b, True, applied_index),
                )
            return gens.info(gens.by_number[gens.current])

    def store(
        self,
        messages: Sequence[pb.Message],
        now_us: int,
        *,
        sync: bool = False,
        applied_index: int | None = None,
        dedup: tuple[bytes, int] | None = None,
        encoded: Sequence[bytes] | None = None,
    ) -> int:
        """Store messages in the current generation; return the first timestamp.

        Message ``i`` gets timestamp ``first + i``. Messages must be valid
        (the API layer checks them) and ``timestamp_us``/``shard`` unset.
        With ``dedup=(producer, sequence)``, a pair stored less than
        ``DEDUP_WINDOW_US`` before ``now_us`` is not stored again: the first
        timestamp it got then is returned (a different message count for the
        pair is refused with INVALID_REQUEST). Every input is in the Raft log,
        so every replica decides the same. ``encoded``, if given, holds each
        message's bytes as logged, stored as they are (saves encoding them).
        """
        (result,) = self.store_many(
            [StorePart(messages, now_us, dedup, encoded)], sync=sync, applied_index=applied_index
        )
        if isinstance(result, errors.MqdsError):
            raise result
        return result

    def store_many(
        self,
        parts: Sequence[StorePart],
        *,
        sync: bool = False,
        applied_index: int | None = None,
        also: Callable[[WriteBatch], None] | None = None,
    ) -> list[int | errors.MqdsError]:
        """Store several batches in one RocksDB write (group commit); each one's first timestamp, or its refusal.

        The parts are stored in order, each as ``store`` would store it alone
        (its own ``now_us`` and deduplication pair; a pair stored by an
        earlier part of the same call counts as stored). A refusal (a reused
        sequence number) is that part's result and stores nothing of it.
        ``also`` adds changes of the caller's to the same write (a delivery
        step's, with the dead letters it stores).
        """
        with self._lock:
            results: list[int | errors.MqdsError] = []
            batch = WriteBatch(raw_mode=True)
            meta = self._meta_handle
            gen = self._generations.by_number[self._generations.current]
            last_ts = self.last_ts
            built: list[writes.StoreBatch] = []
            here: dict[bytes, keys.DedupRecord] = {}
            for part in parts:
                messages, now_us = part.messages, part.now_us
                dedup_key = None
                if part.dedup is not None:
                    dedup_key = keys.dedup_key(*part.dedup)
                    seen = here.get(dedup_key) or dedups.seen(self._db, dedup_key, now_us)
                    if seen is not None:
                        results.append(self._seen_result(part, seen))
                        continue
                first = max(now_us, last_ts + 1)
                values = part.encoded if part.encoded is not None else [m.SerializeToString() for m in messages]
                stored = writes.build(gen, messages, values, first, last_ts, self._routes, meta, batch)
                built.append(stored)
                last_ts = stored.last_ts
                if dedup_key is not None:
                    dedups.remember(batch, meta, dedup_key, first, len(messages), now_us)
                    here[dedup_key] = keys.DedupRecord(first, len(messages), now_us)
                results.append(first)
            now = max((part.now_us for part in parts), default=0)
            pruned = dedups.prune(self._db, batch, meta, now, self._dedup_pruned) if built else self._dedup_pruned
            if also is not None:
                also(batch)
            try:
                self._write(batch, sync, applied_index)
            except BaseException:
                for stored in reversed(built):
                    writes.undo(stored, gen, self._routes)
                raise
            self.last_ts = last_ts
            self._dedup_pruned = pruned
            return results

    def _store_dead(
        self, encoded: list[bytes], now_us: int, also: Callable[[WriteBatch], None], applied_index: int | None
    ) -> int:
        """Store dead letters (``deliveries.py``) with the delivery step's changes in one write; the first
        timestamp. Their senders are those of messages of this shard, so they belong here."""
        messages = [pb.Message.FromString(m) for m in encoded]
        (first,) = self.store_many([StorePart(messages, now_us, None, encoded)], applied_index=applied_index, also=also)
        assert isinstance(first, int)  # no deduplication pair: nothing to refuse
        return first

    def _seen_result(self, part: StorePart, seen: keys.DedupRecord) -> int | errors.MqdsError:
        """The answer to a part whose (producer, sequence) was stored already: its first timestamp then."""
        if seen.count == len(part.messages):
            return seen.first_ts
        assert part.dedup is not None
        producer, sequence = part.dedup
        return errors.error(
            Reason.INVALID_REQUEST,
            f"producer {producer!r} sequence {sequence} was stored with {seen.count} messages "
            f"in shard {self.shard}, not {len(part.messages)}: a sequence number was reused",
        )

    def add_generation(self, now_us: int, *, applied_index: int | None = None) -> GenerationInfo:
        """Close the current generation and open a new one starting now."""
        with self._lock:
            gens = self._generations
            self.last_ts = gens.add(
                self._db,
                self._engine,
                self._meta_handle,
                now_us,
                self.last_ts,
                lambda b: self._write(b, True, applied_index),
            )
            return gens.info(gens.by_number[gens.current])

    def drop_generation(self, number: int, *, applied_index: int | None = None) -> GenerationInfo:
        """Drop a closed generation: its metadata, then its column family; then free the disk it took.

        Its SST files go once no reader holds them. Its writes also sit in
        RocksDB's write-ahead log files, which are deleted only once every
        column family with writes in them has flushed, and the metadata
        family is written with every batch: so the other families' memtables
        are flushed too, in the background (no wait: this runs in the apply
        path), and the log files go with them. Without that, a node past its
        disk quota (``diskusage.py``) gained little from a drop.
        """
        with self._lock:
            info = self._generations.drop(
                self._db,
                self._meta_handle,
                number,
                self.trie,
                lambda b: self._write(b, True, applied_index),
                self._routes.clear,
            )
            for cf in self._families():
                cf.flush(False)
            return info

    def applied_part(self, index: int) -> int:
        """The last part of log entry ``index`` already written (-1 for none).

        An entry applied in several writes (a group commit holding session
        commands, which read what the ones before them wrote) records each
        part it wrote with ``begin_part``, and the applied index with its
        last write; replaying it after a crash skips the parts written.
        """
        raw = self._db.get(keys.META_APPLIED_PART)
        if raw is None or len(raw) != 12 or keys.read_u64(raw[:8]) != index:
            return -1
        return keys.read_u32(raw[8:])

    def begin_part(self, index: int, part: int | None) -> None:
        """The writes from now on are part ``part`` of log entry ``index`` (None: no longer)."""
        self.part_mark = None if part is None else keys.u64(index) + keys.u32(part)

    def record_applied(self, applied_index: int) -> None:
        """Record a log index whose command changed nothing in this shard."""
        with self._lock:
            self._write(WriteBatch(raw_mode=True), False, applied_index)

    # -- deletes and retention (``deletes.py``, ``retention.py``; ``compaction.py`` gives the disk back) -------

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
        self._compactions.soon(result.ranges)
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
        self._compactions.soon(result.ranges)
        return result

    def retention_due(self, policy: retention.Policy, now_us: int, after_us: int) -> tuple[list[int], bool]:
        """The closed generations the policy lets drop whole, and whether a pass may find messages to remove."""
        with self._lock:
            gens = self._generations.in_order()
            drops = [g.number for g in gens if retention.droppable(g, self.trie, policy, now_us)]
            kept = [g for g in gens if g.number not in drops]
            return drops, retention.may_have_expired(kept, self.trie, policy, now_us, after_us)

    def limit_scan(self, policy: limits.LimitPolicy, scan: limits.LimitScan, budget: int, doomed: limits.Doomed) -> int:
        """Go on with a newest-first pass over a rule's messages (``limits.py``); the keys it read (at most ``budget``).

        Reads only: what is over the rule's limits is added to ``doomed``, for the leader to log."""
        with self._lock:
            return limits.scan_step(self.trie, self._generations.in_order(), policy, scan, budget, doomed)

    def trim_messages(
        self, streams: Iterable[limits.TrimmedStream], *, applied_index: int | None = None
    ) -> deletes.StepResult:
        """Delete the messages a leader found over a rule's limits (``limits.trim``): those still held."""
        with self._lock:
            batch = WriteBatch(raw_mode=True)
            result = limits.trim(self._generations.by_number, streams, batch)
            self._count_changes(result, batch)
            self._write(batch, False, applied_index)
        self._compactions.soon(result.ranges)
        return result

    def expire_messages(self, now_us: int, max_count: int, *, applied_index: int | None = None) -> deletes.StepResult:
        """One step removing stored messages whose Message Expiry Interval ended by ``now_us`` (``expiry.py``): at
        most ``max_count`` index entries, the messages they name (``limits.trim``) with them."""
        with self._lock:
            batch = WriteBatch(raw_mode=True)
            live = self._generations.by_number
            expired, entries = expiry.due_messages(self._metadata, live.keys(), now_us, max_count, batch)
            result = limits.trim(live, expired, batch)
            result.scanned += entries
            self._count_changes(result, batch)
            self._write(batch, False, applied_index)
        self._compactions.soon(result.ranges)
        self.metadata_deleted(entries)
        return result

    def messages_expiry_due(self, now_us: int) -> bool:
        """Whether an ``expire_messages`` step has something to remove at ``now_us`` (reads the index's heads)."""
        with self._lock:
            return expiry.due_messages(self._metadata, self._generations.by_number.keys(), now_us, 1)[1] > 0

    def metadata_deleted(self, count: int) -> None:
        """Expiry deleted ``count`` keys of the metadata family: compact it once they outweigh what it holds
        (``ShardCompactions.metadata_deleted``). Called by the apply of an expiry step (one at a time), after its
        write."""
        self._compactions.metadata_deleted(count)

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

    def _compaction_family(self, number: int) -> Rdict | None:
        """For the compaction thread: the family to compact (``METADATA``: the database); None once dropped or
        closed."""
        with self._lock:
            if self._db is None:
                return None
            if number == METADATA:
                return self._db
            gen = self._generations.by_number.get(number)
            return None if gen is None else gen.cf

    def _families(self) -> list[Rdict]:
        """The database (its metadata family) and every generation's family; the caller holds the lock."""
        return [self._db, *(gen.cf for gen in self._generations.by_number.values())]

    def release_logs(self) -> None:
        """Flush every family's memtable (not waited for), so that the write-ahead log files can go: after
        deletes (the compaction thread), or on a node past its disk quota; nothing once the shard closed."""
        with self._lock:
            if self._db is None:
                return
            for cf in self._families():
                cf.flush(False)

    def _metadata_keys(self) -> int:
        """RocksDB's estimate of the metadata family's keys."""
        return int(self._db.property_int_value("rocksdb.estimate-num-keys") or 0)

    # -- restore from a backup (``restore.py``) ----------------------------------------------------------

    def holds(self) -> str | None:
        """What the shard holds that a restore would overwrite (messages, broker state), or None."""
        with self._lock:
            return restore.holds(self._db, restore.generation_families(self.path))

    def _refused(self, refusal: MqdsError, applied_index: int | None) -> MqdsError:
        """A step refused alike by every replica: it changes nothing but the applied index."""
        if applied_index is not None:
            self._write(WriteBatch(raw_mode=True), False, applied_index)
        return refusal

    def _not_restoring(self, step: str, applied_index: int | None) -> MqdsError:
        return self._refused(
            errors.error(
                Reason.NOT_RESTORING,
                f"shard {self.shard} is not being restored: ImportShard {step} comes after a begin put the "
                "shard in restore mode (mqds restore begins, writes, then finishes or abandons every shard); "
                "a restore that finished or was abandoned takes no more steps",
            ),
            applied_index,
        )

    def restore_begin(self, *, applied_index: int | None = None) -> MqdsError | None:
        """Clear an empty shard and put it in restore mode; the refusal (SHARD_NOT_EMPTY) when it is not empty."""
        with self._lock:
            what = self.holds()
            if what is not None:
                under_way = (
                    " written by a restore under way: finish it, or abandon it (mqds restore --abandon) and begin again"
                    if self.restoring
                    else ": a backup is restored into a new, empty cluster only"
                )
                return self._refused(
                    errors.error(Reason.SHARD_NOT_EMPTY, f"shard {self.shard} holds {what}{under_way}"),
                    applied_index,
                )
            self._clear(restoring=True, applied_index=applied_index)
            return None

    def _clear(self, *, restoring: bool, applied_index: int | None) -> None:
        """Delete every key but the shard's identity and Raft state, and every generation; the shard in restore
        mode or out of it."""
        batch = restore.clear_batch(self._db, self._meta_handle, restoring=restoring)
        names = restore.generation_families(self.path)
        self._generations.by_number.clear()
        self._write(batch, True, applied_index)
        for name in names:
            self._db.drop_column_family(name)
        self.reload()

    def restore_records(
        self,
        column_family: str,
        keys_: Sequence[bytes],
        values: Sequence[bytes],
        *,
        applied_index: int | None = None,
    ) -> int | MqdsError:
        """Write records of one column family as they are (creating a generation's family); how many.

        Outside restore mode the records are refused (NOT_RESTORING) and nothing is written.
        """
        with self._lock:
            if not self.restoring:
                return self._not_restoring("records", applied_index)
            handle = (
                self._meta_handle
                if column_family == restore.DEFAULT_CF
                else restore.family_handle(self._db, column_family, self._engine.cf_options())
            )
            batch = WriteBatch(raw_mode=True)
            for key, value in zip(keys_, values, strict=True):
                batch.put(key, value, handle)
            latest = max(self.restored_ts, restore.records_ts(column_family, keys_, values))
            if latest > self.restored_ts:
                batch.put(keys.META_RESTORING, keys.u64(latest), self._meta_handle)
            self._write(batch, False, applied_index)
            self.restored_ts = latest
            return len(keys_)

    def restore_finish(self, last_ts: int, *, applied_index: int | None = None) -> list[GenerationInfo] | MqdsError:
        """Set the last timestamp to the backup's fence, end restore mode and read the views again; the
        generations restored. Refused (nothing changes) outside restore mode, and below the records' timestamps."""
        with self._lock:
            if not self.restoring:
                return self._not_restoring("finish", applied_index)
            if last_ts < self.restored_ts:
                return self._refused(
                    errors.error(
                        Reason.INVALID_REQUEST,
                        f"shard {self.shard}: last_ts {last_ts} is before timestamp {self.restored_ts} of the "
                        "records written: finish with the backup's fence (its manifest's fence_us), or abandon "
                        "the restore",
                    ),
                    applied_index,
                )
            batch = WriteBatch(raw_mode=True)
            batch.put(keys.META_LAST_TS, keys.u64(last_ts), self._meta_handle)
            batch.delete(keys.META_RESTORING, self._meta_handle)
            self._write(batch, True, applied_index)
            self.reload()
            return self.generations()

    def restore_abandon(self, *, applied_index: int | None = None) -> MqdsError | None:
        """Clear what the restore wrote and end restore mode: the shard is empty and writable again.

        Refused (NOT_RESTORING, nothing changes) outside restore mode: a shard that holds data is never cleared.
        """
        with self._lock:
            if not self.restoring:
                return self._not_restoring("abandon", applied_index)
            self._clear(restoring=False, applied_index=applied_index)
            return None

    # -- reads ---------------------------------------------------------------

    @property
    def current_generation(self) -> int:
        return self._generations.current

    def generations(self) -> list[GenerationInfo]:
        with self._lock:
            return self._generations.infos()

    @property
    def generation_count(self) -> int:
        """How many generations there are, without waiting for the lock (for status reports).

        The length of a dict is one atomic read; a status call must never wait
        behind a write that holds the lock on a slow or failing disk.
        """
        return len(self._generations.by_number)

    def expired_generations(self, now_us: int, retention_us: int) -> list[int]:
        """Closed generations whose interval ended before ``now_us - retention_us``."""
        with self._lock:
            return self._generations.expired(now_us, retention_us)

    def get_streams(self, filter_levels: list[str], start_time_us: int) -> list[StreamRef]:
        """Streams with data that may match the filter, by generation then stream id."""
        with self._lock:
            # Under the lock: a drop may remove streams from the trie.
            return reads.find_streams(self.trie, self._generations.in_order(), filter_levels, start_time_us)

    def _check_fence(self, fence_us: int | None) -> None:
        if fence_us is not None and self.last_ts < fence_us:
            raise errors.error(
                Reason.REPLICA_BEHIND,
                f"this replica of shard {self.shard} has applied up to timestamp {self.last_ts}, "
                f"not yet the fence {fence_us}",
            )

    def make_iterator(
        self, generation: int, stream: int, topic_filter: str, start_time_us: int, fence_us: int | None = None
    ) -> IteratorState:
        """An iterator over ``stream`` of ``generation``; with ``fence_us``, refused (REPLICA_BEHIND) by a replica
        that has not applied that far, which may not know the stream yet (as :meth:`next`)."""
        with self._lock:
            self._check_fence(fence_us)
            self._generations.get(generation)
            if not self.trie.is_stream(stream):
                raise errors.error(Reason.UNKNOWN_STREAM, f"shard {self.shard} has no stream {stream}")
            pattern = self.trie.pattern(stream)
        reads.check_filter(pattern, stream, topic_filter)
        return IteratorState(self.shard, generation, stream, topic_filter, start_time_us)

    def next(
        self, state: IteratorState, batch_size: int, fence_us: int | None = None, max_bytes: int | None = None
    ) -> ReadResult:
        """Read up to ``batch_size`` messages after the iterator's position.

        With ``max_bytes``, the read also stops before the message that would
        take the stored bytes returned past it (the first message always
        comes), and the state is positioned right after the last one returned.

        With ``fence_us``, only messages stored at or before it, and the stream
        ends once they are all read: nothing at or before the fence can come
        any more once this replica assigned it (timestamps only grow). A
        replica that has not assigned the fence yet refuses (REPLICA_BEHIND).
        """
        with self._lock:
            # First: a replica this far behind may not know the stream (or the
            # generation) yet, and that must read as "ask another replica".
            self._check_fence(fence_us)
            gen = self._generations.get(state.generation)
            if not self.trie.is_stream(state.stream):
                raise errors.error(Reason.UNKNOWN_STREAM, f"shard {self.shard} has no stream {state.stream}")
            pattern = self.trie.pattern(state.stream)
            # Read before scanning: a generation closed after this point is
            # reported as ended by the next call, never too early.
            closed = gen.record.until_us is not None
        # The scan runs without the lock (see DESIGN.md, "Reads and drops").
        cost = reads.ReadCost()
        try:
            return reads.read(gen.cf, state, pattern, closed, fence_us, batch_size, max_bytes, cost)
        finally:
            self.keys_read += cost.keys

    @property
    def initialized(self) -> bool:
        """True once the shard has a generation (the first logged command creates it)."""
        return bool(self._generations.by_number)

    # -- files (nothing here changes what the shard holds) -----------------------------------------------

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
            for cf in self._families():
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

"""One shard's storage: a RocksDB database cut into generations and streams.

The storage layer knows nothing of Raft or gRPC requests. Every change comes
in as a call with all its inputs (messages, the time to use, the log index it
belongs to), so replaying the same calls gives the same content on every
replica: timestamps come from ``now_us`` given by the caller, never from the
clock; trie node ids come from creation order. Each change is one RocksDB
write batch, which also records the applied log index when one is given.

See ``keys.py`` for the key layout and ``DESIGN.md`` for the why.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from rocksdict import (
    BlockBasedOptions,
    Cache,
    Checkpoint,
    DBCompressionType,
    Env,
    Options,
    Rdict,
    WriteBatch,
    WriteBufferManager,
    WriteOptions,
)

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.protocol.topics import matches_levels
from mqds.server.storage import keys
from mqds.server.storage.iterators import IteratorState
from mqds.server.storage.sessions import SessionState
from mqds.server.storage.trie import TopicTrie, filter_constraints
from mqds.v1 import storage_pb2 as pb

log = logging.getLogger(__name__)

# "No fence": above every timestamp.
_NO_FENCE = 1 << 64
# Values an indexed read fetches at once when its answer has a byte budget.
_BUDGET_CHUNK = 32

# How many topic -> key-prefix routes a shard caches before starting over.
_ROUTE_CACHE_LIMIT = 100_000

DEDUP_WINDOW_US = 600_000_000
"""How long a shard remembers a (producer, sequence) batch it stored: 10 minutes
of the leader's clock, far longer than any client retries one call."""
DEDUP_PRUNE_PERIOD_US = 60_000_000
"""Forgotten records are deleted at most once per period (of logged time)."""


@dataclass(frozen=True)
class EngineOptions:
    """RocksDB tuning shared by all shards of a node."""

    block_cache_bytes: int = 64 * 1024 * 1024
    """Block cache shared by all shards, in bytes."""
    write_buffer_bytes: int = 128 * 1024 * 1024
    """Memtable memory for all shards together, in bytes."""
    memtable_bytes: int = 8 * 1024 * 1024
    """Size of one memtable (per column family), in bytes: the mean, see ``memtable_jitter``."""
    memtable_jitter: float = 0.3
    """Each column family's memtable size is drawn at random within this fraction of ``memtable_bytes``."""
    compaction_low_priority: bool = True
    """Run RocksDB's compaction threads at the lowest CPU and I/O priority."""
    bytes_per_sync: int = 1024 * 1024
    """Have the kernel write RocksDB's files (WAL, SST) out every this many bytes as they grow (0 = never)."""


class Engine:
    """The RocksDB options, cache and memtable budget shared by a node's shards."""

    def __init__(self, options: EngineOptions | None = None) -> None:
        self.options = options or EngineOptions()
        self._cache = Cache(self.options.block_cache_bytes)
        self._write_buffers = WriteBufferManager(self.options.write_buffer_bytes, False)
        self._env = Env()
        if self.options.compaction_low_priority:
            # Compactions are background work; the foreground (Raft, applying,
            # answering) must not wait for them. They came in bursts (every
            # shard of a node, loaded alike, compacting at about the same
            # time) and put p99 write latency at half load at 270-350 ms
            # instead of 60-130 ms. Flushes keep their priority: a flush that
            # cannot keep up stalls writes.
            self._env.lower_thread_pool_cpu_priority()
            self._env.lower_thread_pool_io_priority()
        self.sync_write = WriteOptions()
        self.sync_write.sync = True
        self.async_write = WriteOptions()
        # A batch's keys come in runs (one stream, rising timestamps): let
        # the memtable insert each after the previous one (~13% faster).
        self.async_write.memtable_insert_hint_per_batch = True

    def memtable_size(self) -> int:
        """A column family's memtable size: ``memtable_bytes`` give or take ``memtable_jitter``, at random.

        The replicas of a shard apply the same writes at the same pace, and
        the bench's shards are loaded alike: with one size, every loaded
        column family of every node filled its memtable at the same moment,
        and the flushes, all at once, held up writes. p99 at half load was
        97-241 ms with one size, 92-159 ms with sizes spread by 30% (five
        alternating pairs of runs), and each pair went the same way.
        """
        jitter = self.options.memtable_jitter
        return int(self.options.memtable_bytes * (1 + jitter * (2 * random.random() - 1)))

    def db_options(self) -> Options:
        opts = self.cf_options()
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        opts.set_write_buffer_manager(self._write_buffers)
        opts.set_env(self._env)
        opts.set_max_background_jobs(2)
        opts.set_keep_log_file_num(2)
        opts.set_max_total_wal_size(64 * 1024 * 1024)
        if self.options.bytes_per_sync:
            # RocksDB's WAL is not synced (the Raft log is) and its SST files
            # only at the end: their dirty pages used to be written back in
            # bursts of 100-200 MB/s, and every Raft log fdatasync on the disk
            # waited behind them (50-150 ms, on all nodes of a shared disk at
            # once: the slow writes at half load). Written back as they grow,
            # no burst builds up.
            opts.set_bytes_per_sync(self.options.bytes_per_sync)
            opts.set_wal_bytes_per_sync(self.options.bytes_per_sync)
        return opts

    def cf_options(self) -> Options:
        opts = Options(raw_mode=True)
        table = BlockBasedOptions()
        table.set_block_cache(self._cache)
        table.set_bloom_filter(10, False)
        opts.set_block_based_table_factory(table)
        opts.set_write_buffer_size(self.memtable_size())
        opts.set_compression_type(DBCompressionType.lz4())
        return opts


@dataclass(frozen=True)
class GenerationInfo:
    """A generation of a shard and the time interval it covers."""

    shard: int
    generation: int
    since_us: int
    until_us: int | None
    created_at_us: int

    @property
    def current(self) -> bool:
        return self.until_us is None


@dataclass
class _Generation:
    number: int
    record: keys.GenerationRecord
    cf: Rdict
    handle: object
    present: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class ReadResult:
    """What ``next`` read: (timestamp, stored message bytes) pairs, oldest first."""

    entries: list[tuple[int, bytes]]
    state: IteratorState
    end_of_stream: bool


@dataclass(frozen=True)
class StreamRef:
    generation: int
    stream: int
    pattern: str


@dataclass(frozen=True)
class DiskUsage:
    """A shard's size as RocksDB accounts it (SST files; memtables are not on disk yet)."""

    generation_bytes: dict[int, int]
    """SST bytes of each generation's column family, by generation number."""
    metadata_bytes: int
    """SST bytes of the metadata family (trie, generation records, dedup memory, broker state)."""
    memtable_bytes: int
    """Bytes in memtables, all families together: written, not flushed to SST files yet."""


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
        self._routes: dict[str, tuple[bytes, tuple[bytes, ...], int]] = {}
        self._gens: dict[int, _Generation] = {}
        self._current = 0
        self.last_ts = 0
        self.applied_index = 0
        self._dedup_pruned = 0
        self.keys_read = 0
        """Keys read by ``next`` since the shard was opened (a cost measure)."""

        os.makedirs(path, exist_ok=True)
        existing = Rdict.list_cf(path) if os.path.exists(os.path.join(path, "CURRENT")) else ["default"]
        cf_opts = {name: engine.cf_options() for name in existing if name != "default"}
        self._db = Rdict(path, engine.db_options(), column_families=cf_opts or None)
        self._meta_handle = self._db.get_column_family_handle("default")
        self.trie = self._load(lts_threshold_top, lts_threshold, existing)
        self.sessions = SessionState(self)
        """Client state, subscriptions, retained messages and read positions kept in this shard."""

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
        for key, value in self._scan(db, keys.TRIE_PREFIX):
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

        records = {
            keys.read_u32(key[len(keys.GENERATION_PREFIX) :]): keys.GenerationRecord.decode(value)
            for key, value in self._scan(db, keys.GENERATION_PREFIX)
        }
        for name in cf_names:
            number = keys.parse_generation_cf(name)
            if number is not None and number not in records:
                # Created by a rotation that crashed before its metadata was
                # written, or left by a drop that crashed after it: not part of
                # the shard's state either way.
                log.warning("shard %d: dropping orphan column family %s", self.shard, name)
                db.drop_column_family(name)
        for number, record in sorted(records.items()):
            self._open_generation(number, record)
        for key, _ in self._scan(db, keys.PRESENCE_PREFIX):
            generation, stream = keys.parse_presence_key(key)
            if generation in self._gens:
                self._gens[generation].present.add(stream)
        if self._gens:
            self._current = max(self._gens)
        return trie

    @staticmethod
    def _scan(cf: Rdict, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        for key, value in cf.items(from_key=prefix):
            if not key.startswith(prefix):
                return
            yield key, value

    def _open_generation(self, number: int, record: keys.GenerationRecord) -> _Generation:
        name = keys.generation_cf(number)
        try:
            cf = self._db.get_column_family(name)
        except Exception:  # a record without its column family: created now
            cf = self._db.create_column_family(name, self._engine.cf_options())
        gen = _Generation(number, record, cf, self._db.get_column_family_handle(name))
        self._gens[number] = gen
        return gen

    def close(self) -> None:
        """Close the database. Column family handles go first, or RocksDB stays locked."""
        with self._lock:
            self._gens.clear()
            self._meta_handle = None
            db, self._db = self._db, None
            if db is not None:
                db.close()

    # -- writes (deterministic state transitions) -----------------------------

    def _write(self, batch: WriteBatch, sync: bool, applied_index: int | None) -> None:
        if applied_index is not None:
            batch.put(keys.META_APPLIED, keys.u64(applied_index), self._meta_handle)
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
        return self._scan(self._db, prefix)

    def initialize(self, now_us: int, *, applied_index: int | None = None) -> GenerationInfo:
        """Create generation 1 if the shard has none; return the current generation."""
        with self._lock:
            if not self._gens:
                record = keys.GenerationRecord(since_us=0, until_us=None, created_at_us=now_us)
                name = keys.generation_cf(1)
                self._db.create_column_family(name, self._engine.cf_options())
                batch = WriteBatch(raw_mode=True)
                batch.put(keys.generation_key(1), record.encode(), self._meta_handle)
                try:
                    self._write(batch, True, applied_index)
                except BaseException:
                    self._db.drop_column_family(name)
                    raise
                self._open_generation(1, record)
                self._current = 1
            return self._info(self._gens[self._current])

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
        timestamp it got then is returned. Every input is in the Raft log,
        so every replica decides the same. ``encoded``, if given, holds each
        message's bytes as logged, stored as they are (saves encoding them).
        """
        with self._lock:
            dedup_key = None
            if dedup is not None:
                dedup_key = keys.dedup_key(*dedup)
                seen = self._seen(dedup_key, now_us)
                if seen is not None:
                    self._write(WriteBatch(raw_mode=True), False, applied_index)
                    if seen.count != len(messages):
                        raise errors.error(
                            Reason.INVALID_REQUEST,
                            f"producer {dedup[0]!r} sequence {dedup[1]} was stored with {seen.count} messages "
                            f"in shard {self.shard}, not {len(messages)}: a sequence number was reused",
                        )
                    return seen.first_ts
            gen = self._gens[self._current]
            first = max(now_us, self.last_ts + 1)
            handle = gen.handle
            present = gen.present
            routes = self._routes
            if len(routes) > _ROUTE_CACHE_LIMIT:
                routes.clear()
            batch = WriteBatch(raw_mode=True)
            put = batch.put
            new_edges: list[tuple[int, str, int]] = []
            new_streams: list[int] = []
            # Per topic: its data key prefix, the positions of its messages in
            # this batch, and its route (index key prefixes, stream).
            groups: dict[str, tuple[bytes, list[int], tuple[bytes, tuple[bytes, ...], int]]] = {}
            position = 0
            values = encoded if encoded is not None else [message.SerializeToString() for message in messages]
            for message, value in zip(messages, values, strict=True):
                topic = message.topic
                group = groups.get(topic)
                if group is None:
                    route = routes.get(topic)
                    if route is None:
                        route = self._route(topic, new_edges)
                    group = groups[topic] = (route[0], [], route)
                put(group[0] + (first + position).to_bytes(8, "big"), value, handle)
                group[1].append(position)
                position += 1
            ts = first + position
            # One index key per (level, value) for the whole batch, listing its messages.
            postings: dict[bytes, list[list[int]]] = {}
            for _, positions, (_, iprefixes, stream) in groups.values():
                for iprefix in iprefixes:
                    postings.setdefault(iprefix, []).append(positions)
                if stream not in present:
                    present.add(stream)
                    new_streams.append(stream)
            for iprefix, lists in postings.items():
                merged = lists[0] if len(lists) == 1 else sorted(itertools.chain.from_iterable(lists))
                put(iprefix + (first + merged[0]).to_bytes(8, "big"), keys.encode_postings(merged), handle)
            meta = self._meta_handle
            for parent, token, child in new_edges:
                put(keys.trie_edge_key(parent, token), keys.u32(child), meta)
            if new_edges:
                put(keys.META_NEXT_NODE, keys.u32(self.trie.next_node), meta)
            for stream in new_streams:
                put(keys.presence_key(gen.number, stream), b"", meta)
            last = ts - 1 if messages else self.last_ts
            put(keys.META_LAST_TS, keys.u64(last), meta)
            if dedup_key is not None:
                put(dedup_key, keys.DedupRecord(first, len(messages), now_us).encode(), meta)
                put(keys.dedup_expiry_key(now_us, dedup_key), b"", meta)
            pruned = self._prune_dedup(batch, now_us)
            try:
                self._write(batch, sync, applied_index)
            except BaseException:
                # Nothing of the batch is on disk: forget what it taught the
                # trie too, or a later store would route through edges that
                # were never persisted.
                present.difference_update(new_streams)
                self.trie.forget(new_edges)
                self._routes.clear()
                raise
            self.last_ts = last
            self._dedup_pruned = pruned
            return first

    def _seen(self, dedup_key: bytes, now_us: int) -> keys.DedupRecord | None:
        raw = self._db.get(dedup_key)
        if raw is None:
            return None
        record = keys.DedupRecord.decode(raw)
        # Expired records count as absent whether or not pruned yet, so the
        # answer never depends on when a replica last pruned.
        return record if now_us - record.stored_at_us <= DEDUP_WINDOW_US else None

    def _prune_dedup(self, batch: WriteBatch, now_us: int) -> int:
        """Delete expired dedup records in ``batch``, once per prune period; the period now."""
        period = now_us // DEDUP_PRUNE_PERIOD_US
        if period <= self._dedup_pruned:
            return self._dedup_pruned
        meta = self._meta_handle
        bound = keys.dedup_expiry_key(max(0, now_us - DEDUP_WINDOW_US), keys.DEDUP_PREFIX)
        start = len(keys.DEDUP_EXPIRY_PREFIX) + 8
        for key, _ in self._scan(self._db, keys.DEDUP_EXPIRY_PREFIX):
            if key >= bound:
                break
            batch.delete(key, meta)
            batch.delete(keys.DEDUP_PREFIX + key[start:], meta)
        batch.put(keys.META_DEDUP_PRUNED, keys.u64(period), meta)
        return period

    def _route(self, topic: str, new_edges: list[tuple[int, str, int]]) -> tuple[bytes, tuple[bytes, ...], int]:
        learned = self.trie.learn(topic.split("/"), new_edges)
        route = (
            keys.data_prefix(learned.stream),
            tuple(
                keys.index_prefix(learned.stream, i, value)
                for i, value in enumerate(learned.varying[: keys.MAX_INDEXED_LEVELS])
            ),
            learned.stream,
        )
        self._routes[topic] = route
        return route

    def add_generation(self, now_us: int, *, applied_index: int | None = None) -> GenerationInfo:
        """Close the current generation and open a new one starting now."""
        with self._lock:
            old = self._gens[self._current]
            since = max(now_us, self.last_ts + 1, old.record.since_us + 1)
            number = self._current + 1
            closed = keys.GenerationRecord(old.record.since_us, since, old.record.created_at_us)
            record = keys.GenerationRecord(since_us=since, until_us=None, created_at_us=now_us)
            name = keys.generation_cf(number)
            self._db.create_column_family(name, self._engine.cf_options())
            batch = WriteBatch(raw_mode=True)
            batch.put(keys.generation_key(old.number), closed.encode(), self._meta_handle)
            batch.put(keys.generation_key(number), record.encode(), self._meta_handle)
            batch.put(keys.META_LAST_TS, keys.u64(since - 1), self._meta_handle)
            try:
                self._write(batch, True, applied_index)
            except BaseException:
                # Without its record the column family is an orphan: drop it
                # now so a retry can create it again.
                self._db.drop_column_family(name)
                raise
            old.record = closed
            self.last_ts = since - 1
            self._open_generation(number, record)
            self._current = number
            return self._info(self._gens[number])

    def drop_generation(self, number: int, *, applied_index: int | None = None) -> GenerationInfo:
        """Drop a closed generation: its metadata, then its column family."""
        with self._lock:
            gen = self._generation(number)
            if number == self._current:
                raise errors.error(
                    Reason.CURRENT_GENERATION,
                    f"generation {number} is the current generation of shard {self.shard}; "
                    "add a generation first, then drop this one",
                )
            info = self._info(gen)
            batch = WriteBatch(raw_mode=True)
            batch.delete(keys.generation_key(number), self._meta_handle)
            batch.delete_range(keys.presence_key(number, 0), keys.presence_key(number + 1, 0), self._meta_handle)
            # Queue acknowledgements of the generation's messages go with them.
            until = gen.record.until_us or 0
            batch.delete_range(keys.queue_ack_key(gen.record.since_us), keys.queue_ack_key(until), self._meta_handle)
            # The trie is the shard's, shared by its generations: the streams
            # that hold data in no generation left go, with the edges that
            # lead only to them (also those left by drops before this was
            # done). Every replica prunes the same trie at the same log index.
            live: set[int] = set()
            for other in self._gens.values():
                if other.number != number:
                    live.update(other.present)
            pruned = self.trie.prune(live)
            for parent, token, _ in pruned:
                batch.delete(keys.trie_edge_key(parent, token), self._meta_handle)
            if pruned:
                # Opening derives next_node from the edges when the key is
                # missing: keep it, so removed ids are never handed out again.
                batch.put(keys.META_NEXT_NODE, keys.u32(self.trie.next_node), self._meta_handle)
            try:
                self._write(batch, True, applied_index)
            except BaseException:
                for parent, token, child in pruned:
                    self.trie.restore_edge(parent, token, child)
                raise
            if pruned:
                self._routes.clear()
            del self._gens[number]
            # Readers holding the column family keep reading it until they
            # let go; RocksDB deletes the files after that.
            self._db.drop_column_family(keys.generation_cf(number))
            return info

    def record_applied(self, applied_index: int) -> None:
        """Record a log index whose command changed nothing in this shard."""
        with self._lock:
            self._write(WriteBatch(raw_mode=True), False, applied_index)

    # -- reads ---------------------------------------------------------------

    def _info(self, gen: _Generation) -> GenerationInfo:
        r = gen.record
        return GenerationInfo(self.shard, gen.number, r.since_us, r.until_us, r.created_at_us)

    def _generation(self, number: int) -> _Generation:
        gen = self._gens.get(number)
        if gen is not None:
            return gen
        if 0 < number < self._current:
            raise errors.error(
                Reason.GENERATION_DROPPED,
                f"generation {number} of shard {self.shard} was dropped; call GetStreams again for current streams",
            )
        raise errors.error(
            Reason.UNKNOWN_GENERATION,
            f"shard {self.shard} has no generation {number} (current is {self._current})",
        )

    @property
    def current_generation(self) -> int:
        return self._current

    def generations(self) -> list[GenerationInfo]:
        with self._lock:
            return [self._info(self._gens[n]) for n in sorted(self._gens)]

    def estimated_keys(self, number: int) -> int:
        """RocksDB's estimate of the keys in a generation (messages and index entries); 0 if unknown."""
        with self._lock:
            gen = self._gens.get(number)
            if gen is None:
                return 0
            try:
                return int(gen.cf.property_int_value("rocksdb.estimate-num-keys") or 0)
            except Exception:  # an estimate only
                return 0

    def disk_usage(self) -> DiskUsage:
        """The shard's size from RocksDB's properties: cheap (no file walk), for the metrics scrape."""

        def prop(cf: Rdict, name: str) -> int:
            try:
                return int(cf.property_int_value(name) or 0)
            except Exception:  # a figure for monitoring: unknown counts as 0
                return 0

        with self._lock:
            if self._db is None:
                return DiskUsage({}, 0, 0)
            gens = {n: prop(g.cf, "rocksdb.total-sst-files-size") for n, g in sorted(self._gens.items())}
            memtables = prop(self._db, "rocksdb.cur-size-all-mem-tables") + sum(
                prop(g.cf, "rocksdb.cur-size-all-mem-tables") for g in self._gens.values()
            )
            return DiskUsage(gens, prop(self._db, "rocksdb.total-sst-files-size"), memtables)

    def expired_generations(self, now_us: int, retention_us: int) -> list[int]:
        """Closed generations whose interval ended before ``now_us - retention_us``."""
        with self._lock:
            horizon = now_us - retention_us
            return [
                n
                for n, gen in sorted(self._gens.items())
                if gen.record.until_us is not None and gen.record.until_us <= horizon
            ]

    def get_streams(self, filter_levels: list[str], start_time_us: int) -> list[StreamRef]:
        """Streams with data that may match the filter, by generation then stream id."""
        with self._lock:
            # Patterns under the lock too: a drop may remove streams from the trie.
            candidates = self.trie.match(filter_levels)
            found = []
            for number in sorted(self._gens):
                gen = self._gens[number]
                until = gen.record.until_us
                if until is not None and until <= start_time_us:
                    continue
                for stream in sorted(stream for stream, _ in candidates if stream in gen.present):
                    found.append(StreamRef(gen.number, stream, self.trie.pattern(stream)))
        return found

    def make_iterator(self, generation: int, stream: int, topic_filter: str, start_time_us: int) -> IteratorState:
        with self._lock:
            self._generation(generation)
            if not self.trie.is_stream(stream):
                raise errors.error(Reason.UNKNOWN_STREAM, f"shard {self.shard} has no stream {stream}")
            pattern = self.trie.pattern(stream)
        if filter_constraints(pattern, topic_filter.split("/")) is None:
            raise errors.error(
                Reason.INVALID_TOPIC_FILTER,
                f"topic filter {topic_filter!r} cannot match stream {stream} ({pattern!r}); "
                "use a stream that GetStreams returned for this filter",
            )
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
            if fence_us is not None and self.last_ts < fence_us:
                raise errors.error(
                    Reason.REPLICA_BEHIND,
                    f"this replica of shard {self.shard} has applied up to timestamp {self.last_ts}, "
                    f"not yet the fence {fence_us}",
                )
            gen = self._generation(state.generation)
            if not self.trie.is_stream(state.stream):
                raise errors.error(Reason.UNKNOWN_STREAM, f"shard {self.shard} has no stream {state.stream}")
            pattern = self.trie.pattern(state.stream)
            # Read before scanning: a generation closed after this point is
            # reported as ended by the next call, never too early.
            closed = gen.record.until_us is not None
        fenced = fence_us is not None
        limit = fence_us if fence_us is not None else _NO_FENCE
        filter_levels = state.topic_filter.split("/")
        constraints = filter_constraints(pattern, filter_levels)
        if constraints is None:
            return ReadResult([], state, closed or fenced)
        indexed = {level: value for level, value in constraints.items() if level < keys.MAX_INDEXED_LEVELS}
        if indexed:
            entries, next_ts, exhausted = self._scan_index(
                gen, state, indexed, filter_levels, batch_size, limit, max_bytes
            )
        else:
            # Constraints only on levels too deep to be indexed: scan the
            # stream and check each topic.
            check = filter_levels if constraints else None
            entries, next_ts, exhausted = self._scan_stream(gen, state, batch_size, check, limit, max_bytes)
        return ReadResult(entries, state.advanced(next_ts), (closed or fenced) and exhausted)

    def _scan_stream(
        self,
        gen: _Generation,
        state: IteratorState,
        batch_size: int,
        check: list[str] | None,
        limit: int,
        max_bytes: int | None = None,
    ) -> tuple[list[tuple[int, bytes]], int, bool]:
        prefix = keys.data_prefix(state.stream)
        entries: list[tuple[int, bytes]] = []
        exhausted = True
        next_ts = state.next_ts
        scanned = 0
        budget = _NO_FENCE if max_bytes is None else max_bytes
        parse = pb.Message.FromString
        for key, value in gen.cf.items(from_key=prefix + keys.u64(state.next_ts)):
            if not key.startswith(prefix):
                break
            ts = int.from_bytes(key[5:13], "big")
            if ts > limit:
                break
            if len(entries) == batch_size or (entries and len(value) > budget):
                exhausted = False
                break
            scanned += 1
            next_ts = ts + 1
            if check is None or matches_levels(check, parse(value).topic.split("/")):
                entries.append((ts, value))
                budget -= len(value)
        self.keys_read += scanned + (0 if exhausted else 1)
        return entries, next_ts, exhausted

    def _scan_index(
        self,
        gen: _Generation,
        state: IteratorState,
        constraints: dict[int, str],
        filter_levels: list[str],
        batch_size: int,
        limit: int,
        max_bytes: int | None = None,
    ) -> tuple[list[tuple[int, bytes]], int, bool]:
        level = min(constraints)
        prefix = keys.index_prefix(state.stream, level, constraints[level])
        candidates = self._postings(gen, prefix, state.next_ts, limit)
        entries: list[tuple[int, bytes]] = []
        next_ts = state.next_ts
        exhausted = False
        parse = pb.Message.FromString
        # With a byte budget, values are fetched a few at a time, so what is
        # held beyond the budget stays small.
        chunk = batch_size if max_bytes is None else _BUDGET_CHUNK
        budget = _NO_FENCE if max_bytes is None else max_bytes
        full = False
        while len(entries) < batch_size and not full:
            stamps = list(itertools.islice(candidates, min(chunk, batch_size - len(entries))))
            if not stamps:
                exhausted = True
                break
            values = gen.cf.get([keys.data_key(state.stream, ts) for ts in stamps])
            self.keys_read += len(stamps)
            for ts, value in zip(stamps, values, strict=True):
                if entries and value is not None and len(value) > budget:
                    full = True
                    break
                next_ts = ts + 1
                # The hash may collide and other constrained levels are not
                # indexed: check the topic itself.
                if value is not None and matches_levels(filter_levels, parse(value).topic.split("/")):
                    entries.append((ts, value))
                    budget -= len(value)
        if full:
            return entries, next_ts, False
        if not exhausted:
            exhausted = next(candidates, None) is None
        return entries, next_ts, exhausted

    def _postings(self, gen: _Generation, prefix: bytes, start: int, limit: int) -> Iterator[int]:
        """The timestamps the index keys under ``prefix`` list, from ``start`` up to ``limit``, ascending.

        An index key is named after the first message it lists, so the one
        listing ``start`` may be named before it: begin at the last key at or
        before ``start``.
        """
        width = len(prefix)
        it = gen.cf.iter()
        it.seek_for_prev(prefix + keys.u64(start))
        if not (it.valid() and it.key().startswith(prefix)):
            it.seek(prefix + keys.u64(start))
        while it.valid():
            key = it.key()
            if not key.startswith(prefix):
                return
            first = int.from_bytes(key[width : width + 8], "big")
            if first > limit:
                return
            self.keys_read += 1
            for ts in keys.decode_postings(first, it.value()):
                if ts > limit:
                    return
                if ts >= start:
                    yield ts
            it.next()

    # -- durability and copies ------------------------------------------------

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

    @property
    def initialized(self) -> bool:
        """True once the shard has a generation (the first logged command creates it)."""
        return bool(self._gens)

    # -- inspection ----------------------------------------------------------

    def flush(self, wait_s: float = 120) -> None:
        """Flush every memtable to disk and wait (bounded) for background compactions."""
        with self._lock:
            cfs = [self._db] + [gen.cf for gen in self._gens.values()]
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

    def dump(self) -> Iterator[tuple[str, bytes, bytes]]:
        """Every (column family, key, value), in a stable order: the shard's whole content."""
        with self._lock:
            cfs = [("default", self._db)] + [(keys.generation_cf(n), self._gens[n].cf) for n in sorted(self._gens)]
        for name, cf in cfs:
            for key, value in cf.items():
                yield name, key, value


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# Varint encodings of small lengths, looked up instead of computed per message.
_SMALL_VARINTS = [_varint(n) for n in range(1 << 14)]


def varint(value: int) -> bytes:
    """The protobuf varint encoding of a non-negative integer."""
    return _SMALL_VARINTS[value] if value < 16384 else _varint(value)


_TS_TAG = b"\x39"  # field 7 (timestamp_us), fixed64
_SHARD_TAG = b"\x40"  # field 8 (shard), varint
_pack_ts = struct.Struct("<Q").pack


def shard_field(shard: int) -> bytes:
    """The encoded ``shard`` field of mqds.v1.Message."""
    return _SHARD_TAG + varint(shard)


def message_wire(stored: bytes, timestamp_us: int, shard: int) -> bytes:
    """The serialised mqds.v1.Message for a stored one: fields appended, last wins."""
    return stored + _TS_TAG + _pack_ts(timestamp_us) + shard_field(shard)


def decode_message(stored: bytes, timestamp_us: int, shard: int) -> pb.Message:
    """A stored message as an mqds.v1.Message with its timestamp and shard."""
    return pb.Message.FromString(message_wire(stored, timestamp_us, shard))


def encode_messages(tag: bytes, entries: list[tuple[int, bytes]], shard: int) -> bytes:
    """Stored entries as a repeated mqds.v1.Message field with number ``tag``, ready to send."""
    tail = shard_field(shard)
    parts = []
    for ts, stored in entries:
        item = stored + _TS_TAG + _pack_ts(ts) + tail
        parts.append(tag + varint(len(item)) + item)
    return b"".join(parts)


def repeated_field(tag: bytes, items: list[bytes]) -> bytes:
    """Encode ``items`` as a repeated length-delimited protobuf field."""
    return b"".join(tag + varint(len(item)) + item for item in items)

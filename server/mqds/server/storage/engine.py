"""RocksDB as the shards use it: the options, cache and memtable budget they share.

Every shard of a node is its own database (see ``shard.py``); what they have
in common is tuned here, once: the block cache, the memory all memtables may
take together, the background thread priorities, the write options.
``DESIGN.md`` has the measurements behind the choices. ``scan`` is the one
way the storage layer walks a key prefix.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from rocksdict import (
    BlockBasedOptions,
    Cache,
    DBCompressionType,
    Env,
    Options,
    Rdict,
    ReadOptions,
    WriteBufferManager,
    WriteOptions,
)

from mqds.server.storage.compaction import CompactionThread

INFO_LOG_BYTES = 256 * 1024
"""Size at which a shard's RocksDB info log (``LOG``) rolls over; two old ones are kept."""


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
        self.compactions = CompactionThread()
        """Compactions of what deletes freed (``compaction.py``), one at a time for all shards."""

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
        # RocksDB's info log (LOG) rolls at this size and keeps two old ones: at most 768 KiB a shard.
        # Unrolled, it grew with every flush and compaction for as long as the node ran.
        opts.set_keep_log_file_num(2)
        opts.set_max_log_file_size(INFO_LOG_BYTES)
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
        # A file whose entries are mostly tombstones (expired sessions, deleted messages) is
        # compacted by itself, so the disk they took comes back (compaction.py for range deletions).
        opts.add_compact_on_deletion_collector_factory(1_000, 500, 0.5)
        return opts


def prefix_end(prefix: bytes) -> bytes | None:
    """The first key after every key that starts with ``prefix`` (None: no such key, the prefix is all 0xFF).

    >>> prefix_end(b"s:ab"), prefix_end(b"a\\xff"), prefix_end(b"\\xff")
    (b's:ac', b'b', None)
    """
    trimmed = prefix.rstrip(b"\xff")
    if not trimmed:
        return None
    return trimmed[:-1] + bytes([trimmed[-1] + 1])


def scan(cf: Rdict, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
    """The keys of ``cf`` (a database or a column family) that start with ``prefix``, in order, with their values.

    With ``start`` (a key starting with ``prefix``), from that key on: a listing continued page by page.

    The iterator is bounded to the prefix: without a bound, RocksDB looks for
    the next live key past the prefix, stepping over every deleted key on its
    way (expired sessions leave thousands in the metadata family), and a
    lookup of one client's keys cost milliseconds.
    """
    end = prefix_end(prefix)
    bounded = ReadOptions()  # kept in this frame while the scan runs: the iterator does not hold it
    if end is not None:
        bounded.set_iterate_upper_bound(end)
    for key, value in cf.items(from_key=prefix if start is None else max(prefix, start), read_opt=bounded):
        if not key.startswith(prefix):
            return
        yield key, value

"""Exactly-once: a shard remembers (producer, sequence) and stores a retried batch once."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import pytest
from storage_support import msg, replay

from mqds.protocol.errors import (
    InvalidArgumentError,
    MqdsError,
    Reason,
)
from mqds.server.storage import keys
from mqds.server.storage.shard import (
    Engine,
    EngineOptions,
    ShardStorage,
)
from mqds.v1 import storage_pb2 as pb

# -- exactly-once: (producer, sequence) deduplication ----------------------------

MINUTE_US = 60_000_000


def test_a_repeated_producer_sequence_is_stored_once(tmp_path: Path, engine: Engine) -> None:
    path = str(tmp_path / "shard")
    storage = ShardStorage(path, 0, engine)
    storage.initialize(1)
    batch = [msg("dev/1/t", b"a"), msg("dev/1/t", b"b")]
    first = storage.store(batch, 10 * MINUTE_US, applied_index=2, dedup=(b"p1", 1))
    again = storage.store(batch, 10 * MINUTE_US + 5, applied_index=3, dedup=(b"p1", 1))
    assert again == first
    assert storage.applied_index == 3, "a deduplicated entry still counts as applied"
    # Another sequence, or another producer with the same sequence, is new.
    other_seq = storage.store(batch, 10 * MINUTE_US + 6, applied_index=4, dedup=(b"p1", 2))
    other_producer = storage.store(batch, 10 * MINUTE_US + 7, applied_index=5, dedup=(b"p2", 1))
    assert len({first, other_seq, other_producer}) == 3
    assert [r.message.payload for r in replay(storage, "#")] == [b"a", b"b"] * 3
    storage.close()
    # The records are part of the shard's state: they survive a restart.
    reopened = ShardStorage(path, 0, engine)
    assert reopened.store(batch, 11 * MINUTE_US, applied_index=6, dedup=(b"p2", 1)) == other_producer
    assert len(replay(reopened, "#")) == 6
    reopened.close()


def test_reusing_a_sequence_for_another_batch_is_refused(shard: ShardStorage) -> None:
    shard.store([msg("a/b")], MINUTE_US, applied_index=2, dedup=(b"p", 7))
    with pytest.raises(InvalidArgumentError, match="sequence 7 was stored with 1 messages"):
        shard.store([msg("a/b"), msg("a/c")], MINUTE_US + 1, applied_index=3, dedup=(b"p", 7))
    assert shard.applied_index == 3
    assert len(replay(shard, "#")) == 1


def test_dedup_records_expire_after_the_window_and_are_pruned(shard: ShardStorage) -> None:
    from mqds.server.storage.shard import DEDUP_WINDOW_US

    start = 100 * MINUTE_US
    first = shard.store([msg("a/b")], start, dedup=(b"p", 1))
    inside = shard.store([msg("a/b")], start + DEDUP_WINDOW_US, dedup=(b"p", 1))
    assert inside == first
    # Past the window the pair is new again (whether or not pruned yet).
    after = shard.store([msg("a/b")], start + DEDUP_WINDOW_US + 1, dedup=(b"p", 1))
    assert after != first
    assert len(replay(shard, "#")) == 2
    # A store one prune period later deletes the expired records and their index.
    later = start + 3 * DEDUP_WINDOW_US
    shard.store([msg("a/b")], later, dedup=(b"q", 1))
    dedup_keys = [k for k, _ in shard_meta(shard, keys.DEDUP_PREFIX)]
    expiry_keys = [k for k, _ in shard_meta(shard, keys.DEDUP_EXPIRY_PREFIX)]
    assert dedup_keys == [keys.dedup_key(b"q", 1)]
    assert expiry_keys == [keys.dedup_expiry_key(later, keys.dedup_key(b"q", 1))]


def test_dedup_is_the_same_on_replicas_whatever_their_restarts(tmp_path: Path, engine: Engine) -> None:
    """Two replicas apply the same log; one restarts in the middle. Their contents stay identical."""
    from mqds.server.storage.shard import DEDUP_WINDOW_US

    rng = random.Random(7)
    log = []
    now = MINUTE_US
    for index in range(2, 200):
        now += rng.choice([1, MINUTE_US // 3, DEDUP_WINDOW_US // 4])
        log.append((index, now, rng.randrange(1, 6), (b"p%d" % rng.randrange(3), rng.randrange(1, 20))))
    a = ShardStorage(str(tmp_path / "a"), 0, engine)
    b = ShardStorage(str(tmp_path / "b"), 0, engine)
    for storage in (a, b):
        storage.initialize(1, applied_index=1)
    for step, (index, now_us, count, dedup) in enumerate(log):
        batch = [msg(f"t/{index}/{i}") for i in range(count)]
        for storage in (a, b):
            with suppress(InvalidArgumentError):  # a pair reused for another count: refused on both
                storage.store(batch, now_us, applied_index=index, dedup=dedup)
        if step == len(log) // 2:
            b.close()
            b = ShardStorage(str(tmp_path / "b"), 0, engine)
    contents = []
    for storage in (a, b):
        contents.append(
            (
                [(r.ts, r.message.topic) for r in replay(storage, "#")],
                list(shard_meta(storage, keys.DEDUP_PREFIX)),
                list(shard_meta(storage, keys.DEDUP_EXPIRY_PREFIX)),
            )
        )
        storage.close()
    assert contents[0] == contents[1]
    assert contents[0][1], "the log left some dedup records"


def shard_meta(storage: ShardStorage, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    return storage._scan(storage._db, prefix)


def test_reads_up_to_a_fence_are_repeatable_and_end_there(shard: ShardStorage) -> None:
    shard.store([pb.Message(topic=f"f/{i % 3}/x", payload=str(i).encode()) for i in range(30)], 1000)
    fence = shard.last_ts
    shard.store([pb.Message(topic="f/1/x", payload=b"after")], 2000)

    def read(topic_filter: str, fence_us: int | None, batch: int) -> list[int]:
        seen: list[int] = []
        for ref in shard.get_streams(topic_filter.split("/"), 0):
            state = shard.make_iterator(ref.generation, ref.stream, topic_filter, 0)
            while True:
                result = shard.next(state, batch, fence_us)
                seen.extend(ts for ts, _ in result.entries)
                if result.end_of_stream or (fence_us is None and not result.entries):
                    break
                state = result.state
        return sorted(seen)

    for topic_filter in ("f/+/x", "f/1/x", "#"):
        fenced = read(topic_filter, fence, 4)
        assert fenced and max(fenced) <= fence, topic_filter
        assert fenced == [ts for ts in read(topic_filter, None, 100) if ts <= fence], topic_filter
    # The current generation without a fence never ends; with a fence it does.
    ref = shard.get_streams(["#"], 0)[0]
    state = shard.make_iterator(ref.generation, ref.stream, "#", 0)
    assert not shard.next(state, 1000).end_of_stream
    assert shard.next(state, 1000, fence).end_of_stream
    # A fence the shard has not reached yet is refused: the answer could still change.
    with pytest.raises(MqdsError) as behind:
        shard.next(state, 10, shard.last_ts + 1)
    assert behind.value.reason is Reason.REPLICA_BEHIND


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread priorities from /proc")
def test_compactions_run_at_the_lowest_cpu_priority(tmp_path: Path) -> None:
    """Compaction bursts used to compete with serving calls and showed in write latency."""
    engine = Engine(EngineOptions(compaction_low_priority=True))
    storage = ShardStorage(str(tmp_path / "s"), 0, engine)
    storage.initialize(1)
    # Each flush writes a level-0 file; four of them start a compaction.
    for i in range(5):
        storage.store([pb.Message(topic=f"a/{j}", payload=b"x" * 100, sender="s") for j in range(500)], 10 + i * 1000)
        storage.flush()
    nice = {}
    for task in Path("/proc/self/task").iterdir():
        with suppress(OSError):
            name = (task / "comm").read_text().strip()
            nice[name] = int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])
    storage.close()
    assert nice.get("rocksdb:low") == 19, nice
    # Flushes keep their priority: a flush that cannot keep up stalls writes.
    assert nice.get("rocksdb:high") == 0, nice


def latest_options_file(db_dir: Path) -> Path:
    """RocksDB writes the options it runs with, each column family's too, to a new OPTIONS file on open."""
    return max(db_dir.glob("OPTIONS-*"), key=lambda p: int(p.name.split("-")[1]))


def test_memtable_sizes_are_spread_so_flushes_do_not_come_all_at_once(tmp_path: Path) -> None:
    """Replicas (and alike-loaded shards) with one memtable size flushed at the same moment."""
    engine = Engine(EngineOptions(memtable_bytes=8 << 20, memtable_jitter=0.3))
    storage = ShardStorage(str(tmp_path / "s"), 0, engine)
    storage.initialize(1)
    for i in range(8):
        storage.add_generation(10 + i)
    storage.close()
    latest = latest_options_file(tmp_path / "s")
    sizes = [
        int(line.split("=")[1])
        for line in latest.read_text().splitlines()
        if line.strip().startswith("write_buffer_size=")
    ]
    generations = sizes[1:]  # the first is the default column family's (the metadata)
    assert len(generations) >= 9, sizes
    assert all(0.7 * (8 << 20) <= size <= 1.3 * (8 << 20) for size in sizes), sizes
    assert len(set(generations)) > 1, sizes


@pytest.mark.parametrize("bytes_per_sync", [1 << 20, 0])
def test_rocksdb_files_are_written_back_as_they_grow(tmp_path: Path, bytes_per_sync: int) -> None:
    """Unsynced WAL and SST pages were written back in bursts that stalled every Raft log fdatasync."""
    storage = ShardStorage(str(tmp_path / "s"), 0, Engine(EngineOptions(bytes_per_sync=bytes_per_sync)))
    storage.initialize(1)
    storage.close()
    latest = latest_options_file(tmp_path / "s")
    options = dict(line.strip().split("=", 1) for line in latest.read_text().splitlines() if "=" in line)
    assert options["bytes_per_sync"] == str(bytes_per_sync)
    assert options["wal_bytes_per_sync"] == str(bytes_per_sync)

"""Deleting stored messages in one shard: a sender's, a filter's in a time range, in bounded steps."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from storage_support import msg, replay

from mqds.protocol.topics import matches
from mqds.server.storage.deletes import Cursor, DeleteSpec, StepResult
from mqds.server.storage.iterators import IteratorState
from mqds.server.storage.shard import Engine, ShardStorage

TOPICS = ["a/1/x", "a/2/x", "a/3/y", "b/1", "b/2", "c", "$SYS/x"]
SENDERS = ["s1", "s2", "s3"]
FILTERS = ["#", "a/#", "a/+/x", "b/1", "+/2/#", "c", "$SYS/#", "a/2/#"]


def run_delete(shard: ShardStorage, spec: DeleteSpec, max_keys: int, index: int = 0) -> tuple[int, int, int]:
    """Every step of a delete, as the leader logs them: messages deleted, index keys deleted, steps."""
    cursor: Cursor | None = None
    messages = index_keys = steps = 0
    while True:
        result: StepResult = shard.delete_messages(spec, cursor, max_keys)
        steps += 1
        messages += result.messages
        index_keys += result.index_keys
        assert result.scanned <= max_keys
        spec = DeleteSpec(spec.topic_filter, spec.sender, spec.since_us, result.until_us)
        if result.cursor is None:
            return messages, index_keys, steps
        cursor = result.cursor
        assert steps < 10_000


def content(shard: ShardStorage) -> list[tuple[int, str, str]]:
    return sorted((r.ts, r.message.topic, r.message.sender) for f in ("#", "$SYS/#") for r in replay(shard, f))


stored_batch = st.lists(st.tuples(st.sampled_from(TOPICS), st.sampled_from(SENDERS)), min_size=1, max_size=12)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batches=st.lists(st.tuples(stored_batch, st.booleans()), min_size=1, max_size=8),
    topic_filter=st.sampled_from(FILTERS),
    sender=st.sampled_from(["", *SENDERS]),
    since=st.integers(0, 60),
    length=st.one_of(st.just(0), st.integers(1, 80)),
    max_keys=st.integers(1, 25),
)
def test_a_delete_removes_exactly_what_it_names(
    batches: list[tuple[list[tuple[str, str]], bool]],
    topic_filter: str,
    sender: str,
    since: int,
    length: int,
    max_keys: int,
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        shard = ShardStorage(f"{tmp}/s", 0, Engine())
        try:
            shard.initialize(1)
            now = 1
            for messages, rotate in batches:
                shard.store([msg(t, sender=s) for t, s in messages], now)
                now += len(messages) + 1
                if rotate:
                    shard.add_generation(now)
            before = content(shard)
            until = since + length if length else 0
            deleted, _, _ = run_delete(shard, DeleteSpec(topic_filter, sender, since, until), max_keys)
            bound = until or (1 << 64)
            gone = [
                row
                for row in before
                if matches(topic_filter, row[1]) and (not sender or row[2] == sender) and since <= row[0] < bound
            ]
            assert deleted == len(gone)
            assert content(shard) == sorted(set(before) - set(gone))
            # Index reads (a filter on an indexed level) skip what is gone too.
            for f in ("a/1/#", "a/+/x", "b/2"):
                assert sorted((r.ts, r.message.topic) for r in replay(shard, f)) == sorted(
                    (row[0], row[1]) for row in before if row not in gone and matches(f, row[1])
                )
            # A second run deletes nothing more.
            assert run_delete(shard, DeleteSpec(topic_filter, sender, since, until), max_keys)[0] == 0
        finally:
            shard.close()


def test_the_first_step_fixes_the_upper_bound_so_later_messages_stay(shard: ShardStorage) -> None:
    shard.store([msg("t/a") for _ in range(10)], 10)
    first = shard.delete_messages(DeleteSpec("t/#", "", 0, 0), None, 4)
    assert first.messages == 4 and first.cursor is not None and first.until_us == 20
    shard.store([msg("t/a") for _ in range(5)], 30)  # stored while the delete goes on
    spec = DeleteSpec("t/#", "", 0, first.until_us)
    cursor: Cursor | None = first.cursor
    while cursor is not None:
        step = shard.delete_messages(spec, cursor, 4)
        cursor = step.cursor
    assert [r.ts for r in replay(shard, "t/#")] == [30, 31, 32, 33, 34]


def test_deleting_a_whole_closed_generation_of_a_stream_deletes_its_index_keys(shard: ShardStorage) -> None:
    shard.store([msg(f"dev/{i}/temp") for i in range(300)], 10)  # past the LTS threshold: dev/+/temp, indexed
    old = shard._gens[1].cf
    names = list(old.keys())
    assert any(k.startswith(b"I") for k in names)
    shard.add_generation(1_000)
    shard.store([msg("dev/7/temp")], 2_000)
    deleted, index_keys, _ = run_delete(shard, DeleteSpec("dev/#", "", 0, 1_000), 1_000)
    assert deleted == 300 and index_keys > 0
    assert list(old.keys()) == []  # neither data nor index keys are left in the closed generation
    assert [r.ts for r in replay(shard, "dev/7/#")] == [2_000]


def test_iterators_made_before_a_delete_skip_what_it_deleted(shard: ShardStorage) -> None:
    shard.store([msg("t/a", sender=f"s{i % 2}") for i in range(10)], 10)
    (ref,) = shard.get_streams(["t", "#"], 0)
    state = shard.make_iterator(ref.generation, ref.stream, "t/#", 0)
    first = shard.next(state, 3)
    run_delete(shard, DeleteSpec("#", "s1", 0, 0), 100)
    rest = shard.next(first.state, 100)
    assert [ts for ts, _ in first.entries] == [10, 11, 12]
    assert [ts for ts, _ in rest.entries] == [14, 16, 18]
    assert isinstance(first.state, IteratorState)


def _generation_bytes(shard: ShardStorage, number: int) -> int:
    return shard.disk_usage().generation_bytes.get(number, 0)


@pytest.mark.parametrize("sender", ["", "s1"])
def test_the_disk_a_delete_frees_comes_back(shard: ShardStorage, sender: str) -> None:
    """Range deletions (a whole stream) and per-message deletes (a sender's) both give their disk back:
    RocksDB keeps deleted keys until a compaction drops them, and nothing else would start one soon."""
    for i in range(40):
        shard.store([msg("big/t", payload=os.urandom(200), sender="s1") for _ in range(1_000)], 10 + i * 1_000)
    gen = shard._gens[1]
    gen.cf.flush(True)
    before = _generation_bytes(shard, 1)
    assert before > 4_000_000
    deleted, _, _ = run_delete(shard, DeleteSpec("big/#", sender, 0, 0), 5_000)
    assert deleted == 40_000
    gen.cf.flush(True)
    deadline = time.monotonic() + 30
    while _generation_bytes(shard, 1) > before // 10 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _generation_bytes(shard, 1) <= before // 10, (before, _generation_bytes(shard, 1))


def _log_bytes(shard: ShardStorage) -> int:
    """What the shard's RocksDB write-ahead log files hold on disk."""
    return sum(entry.stat().st_size for entry in os.scandir(shard.path) if entry.name.endswith(".log"))


def test_a_delete_gives_back_the_write_ahead_log_too(shard: ShardStorage) -> None:
    """A shard that stops taking writes once everything is deleted gives back its write-ahead log as well.

    A log file goes only once every column family flushed what it holds; before, the metadata family's
    memtable (the applied index each store writes) kept the logs of everything stored, up to
    max_total_wal_size per shard, long after the data in them was deleted and compacted away."""
    for i in range(40):
        shard.store([msg("wal/t", payload=os.urandom(200), sender="s1") for _ in range(1_000)], 10 + i * 1_000)
    before = _log_bytes(shard)
    assert before > 4_000_000, before
    deleted, _, _ = run_delete(shard, DeleteSpec("wal/#", "", 0, 0), 5_000)
    assert deleted == 40_000
    deadline = time.monotonic() + 30
    while _log_bytes(shard) > before // 10 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _log_bytes(shard) <= before // 10, (before, _log_bytes(shard))

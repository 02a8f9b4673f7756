"""The storage layer of one shard: timestamps, generations, restarts, determinism, failures half-way."""

from __future__ import annotations

import itertools
import os
import random
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rocksdict import Rdict
from storage_support import dir_size, drain, failing_writes, msg, random_message, replay, store_failing

from mqds.protocol.errors import (
    FailedPreconditionError,
    GenerationDroppedError,
    InvalidArgumentError,
    MqdsError,
    NotFoundError,
    Reason,
)
from mqds.server.storage import keys
from mqds.server.storage.iterators import IteratorState
from mqds.server.storage.shard import (
    Engine,
    GenerationInfo,
    ShardStorage,
)

# -- initialisation ------------------------------------------------------------


def test_initialize_creates_generation_one_once(tmp_path: Path, engine: Engine) -> None:
    storage = ShardStorage(str(tmp_path / "s"), 5, engine)
    try:
        assert storage.generations() == []
        info = storage.initialize(1_000)
        assert info == GenerationInfo(
            shard=5, generation=1, since_us=0, until_us=None, created_at_us=1_000, last_before_us=0
        )
        assert info.current
        assert storage.initialize(9_999) == info
        assert storage.generations() == [info]
        assert storage.current_generation == 1
        assert storage.last_ts == 0
        assert storage.trie.streams() == []
    finally:
        storage.close()


# -- timestamps ----------------------------------------------------------------


def test_timestamps_follow_max_of_now_and_last_plus_one(shard: ShardStorage) -> None:
    assert shard.store([msg("t"), msg("t"), msg("t")], 100) == 100
    assert shard.last_ts == 102
    assert shard.store([msg("t")], 100) == 103  # same now
    assert shard.store([msg("t"), msg("t")], 50) == 104  # now went backwards
    assert shard.last_ts == 105
    assert shard.store([msg("t")], 1_000) == 1_000  # now jumped ahead
    assert shard.store([msg("t")], 1_001) == 1_001
    assert shard.store([msg("t")], 0) == 1_002
    # An empty batch assigns nothing.
    assert shard.store([], 5_000) == 5_000
    assert shard.last_ts == 1_002
    assert shard.store([msg("t")], 10) == 1_003
    entries, _, _ = drain(shard, shard.make_iterator(1, shard.trie.streams()[0], "t", 0), 100)
    assert [ts for ts, _ in entries] == [100, 101, 102, 103, 104, 105, 1_000, 1_001, 1_002, 1_003]


ops_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.integers(0, 2_000), st.integers(0, 6)),
        st.tuples(st.just("rotate"), st.integers(0, 2_000), st.just(0)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops_strategy)
def test_timestamps_strictly_increase_whatever_now_does(engine: Engine, ops: list[tuple[str, int, int]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        storage = ShardStorage(tmp, 0, engine)
        try:
            storage.initialize(0)
            last, since = 0, 0
            expected: list[int] = []
            for op, now, n in ops:
                if op == "store":
                    first = storage.store([msg(f"x/{i % 3}", str(i).encode()) for i in range(n)], now)
                    assert first == max(now, last + 1)
                    expected += range(first, first + n)
                    last = first + n - 1 if n else last
                else:
                    info = storage.add_generation(now)
                    since = max(now, last + 1, since + 1)
                    assert info.since_us == since
                    last = since - 1
                assert storage.last_ts == last
            gens = storage.generations()
            for older, newer in itertools.pairwise(gens):
                assert older.until_us == newer.since_us
            seen: list[int] = []
            for read in replay(storage, "#"):
                gen = gens[read.ref.generation - 1]
                assert gen.since_us <= read.ts and (gen.until_us is None or read.ts < gen.until_us)
                assert read.message.timestamp_us == read.ts
                seen.append(read.ts)
            assert sorted(seen) == expected
            assert len(set(expected)) == len(expected)
        finally:
            storage.close()


# -- generations ---------------------------------------------------------------


def test_add_generation_closes_the_old_one(shard: ShardStorage) -> None:
    shard.store([msg("g/a", b"1")], 100)
    info = shard.add_generation(500)
    assert info == GenerationInfo(0, 2, since_us=500, until_us=None, created_at_us=500, last_before_us=100)
    gens = shard.generations()
    assert gens[0] == GenerationInfo(0, 1, since_us=0, until_us=500, created_at_us=1, last_before_us=0)
    assert not gens[0].current and gens[1].current
    assert shard.current_generation == 2
    assert shard.last_ts == 499
    # New messages go to the new generation, even when now is before its start.
    assert shard.store([msg("g/a", b"2")], 300) == 500
    refs = shard.get_streams(["g", "a"], 0)
    assert [(r.generation, r.pattern) for r in refs] == [(1, "g/a"), (2, "g/a")]
    assert refs[0].stream == refs[1].stream
    by_gen = {r.ref.generation: r.message.payload for r in replay(shard, "g/a")}
    assert by_gen == {1: b"1", 2: b"2"}
    # A start time at or after a closed generation's end skips it.
    assert [r.generation for r in shard.get_streams(["g", "a"], 499)] == [1, 2]
    assert [r.generation for r in shard.get_streams(["g", "a"], 500)] == [2]
    assert [r.generation for r in shard.get_streams(["g", "a"], 10**15)] == [2]
    # A stream only shows in the generations where it has data.
    shard.store([msg("g/b", b"3")], 600)
    assert [r.generation for r in shard.get_streams(["g", "b"], 0)] == [2]
    assert len(shard.get_streams(["g", "#"], 0)) == 3


def test_add_generation_start_never_goes_backwards(shard: ShardStorage) -> None:
    shard.store([msg("t")], 1_000)
    assert shard.add_generation(10).since_us == 1_001
    assert shard.add_generation(10).since_us == 1_002  # no messages: still strictly after the previous start
    assert shard.add_generation(5_000).since_us == 5_000
    assert shard.store([msg("t")], 0) == 5_000
    gens = shard.generations()
    assert [(g.since_us, g.until_us) for g in gens] == [(0, 1_001), (1_001, 1_002), (1_002, 5_000), (5_000, None)]
    assert [g.created_at_us for g in gens] == [1, 10, 10, 5_000]


def test_generation_errors(shard: ShardStorage) -> None:
    shard.store([msg("e/1", b"a")], 10)
    stream = shard.trie.streams()[0]
    old_state = shard.make_iterator(1, stream, "e/1", 0)

    with pytest.raises(FailedPreconditionError) as current:
        shard.drop_generation(1)
    assert current.value.reason is Reason.CURRENT_GENERATION
    assert "current generation" in current.value.message

    shard.add_generation(100)
    dropped = shard.drop_generation(1)
    assert dropped.generation == 1 and dropped.until_us == 100
    assert [g.generation for g in shard.generations()] == [2]
    assert shard.get_streams(["e", "1"], 0) == []

    with pytest.raises(GenerationDroppedError) as info:
        shard.next(old_state, 10)
    assert info.value.reason is Reason.GENERATION_DROPPED
    assert "dropped" in info.value.message
    for call in (lambda: shard.make_iterator(1, stream, "e/1", 0), lambda: shard.drop_generation(1)):
        with pytest.raises(GenerationDroppedError) as info:
            call()
        assert info.value.reason is Reason.GENERATION_DROPPED

    # Dropping generation 1 removed its streams (nothing else held them): a
    # stream that exists now, asked of generations that do not.
    shard.store([msg("e/2", b"b")], 200)
    stream = shard.get_streams(["e", "2"], 0)[0].stream
    for number in (0, 3, 99, -1):
        for call in (
            lambda n=number: shard.make_iterator(n, stream, "e/1", 0),
            lambda n=number: shard.next(IteratorState(0, n, stream, "e/1", 0), 1),
            lambda n=number: shard.drop_generation(n),
        ):
            with pytest.raises(NotFoundError) as unknown:
                call()
            assert unknown.value.reason is Reason.UNKNOWN_GENERATION
            assert not isinstance(unknown.value, GenerationDroppedError)

    not_a_stream = 1  # the node of level 'e' has no '#' edge pointing at it
    for bad in (not_a_stream, 12_345):
        with pytest.raises(NotFoundError) as unknown:
            shard.make_iterator(2, bad, "#", 0)
        assert unknown.value.reason is Reason.UNKNOWN_STREAM
        with pytest.raises(NotFoundError) as unknown:
            shard.next(IteratorState(0, 2, bad, "#", 0), 1)
        assert unknown.value.reason is Reason.UNKNOWN_STREAM

    with pytest.raises(InvalidArgumentError) as wrong:
        shard.make_iterator(2, stream, "other/#", 0)
    assert wrong.value.reason is Reason.INVALID_TOPIC_FILTER
    assert "cannot match stream" in wrong.value.message


def test_expired_generations(shard: ShardStorage) -> None:
    assert shard.expired_generations(10**12, 0) == []  # only the current one
    shard.add_generation(1_000)  # generation 1: [0, 1000)
    shard.add_generation(2_000)  # generation 2: [1000, 2000)
    shard.add_generation(3_000)  # generation 3: [2000, 3000); 4 is current
    retention = 500
    assert shard.expired_generations(1_499, retention) == []
    assert shard.expired_generations(1_500, retention) == [1]
    assert shard.expired_generations(2_499, retention) == [1]
    assert shard.expired_generations(2_500, retention) == [1, 2]
    assert shard.expired_generations(3_500, retention) == [1, 2, 3]
    assert shard.expired_generations(10**15, retention) == [1, 2, 3]
    assert shard.expired_generations(0, 0) == []
    shard.drop_generation(1)
    assert shard.expired_generations(10**15, retention) == [2, 3]
    for number in shard.expired_generations(10**15, retention):
        shard.drop_generation(number)
    assert [g.generation for g in shard.generations()] == [4]
    assert shard.expired_generations(10**15, 0) == []


def _big_first_generation(storage: ShardStorage) -> int:
    """4 MiB of random payloads in generation 1, then generation 2 with one small message; the payload bytes."""
    storage.initialize(1)
    payload_bytes = 4 * 1024 * 1024
    for i in range(64):
        storage.store([msg(f"big/{i % 4}", os.urandom(payload_bytes // 64))], 10 + i)
    storage.add_generation(1_000)
    storage.store([msg("small", b"kept")], 1_001)
    return payload_bytes


def test_dropping_a_generation_frees_its_disk(tmp_path: Path, engine: Engine) -> None:
    path = str(tmp_path / "s")
    storage = ShardStorage(path, 0, engine)
    payload_bytes = _big_first_generation(storage)
    storage.close()  # flushes the memtables into SST files
    storage = ShardStorage(path, 0, engine)
    try:
        storage.flush()
        before = dir_size(path)
        assert before > payload_bytes
        storage.drop_generation(1)
        storage.flush()
        after = dir_size(path)
        storage.close()
        storage = ShardStorage(path, 0, engine)
        reopened = dir_size(path)
        assert after < before - payload_bytes * 0.9, (before, after)
        assert reopened < before - payload_bytes * 0.9, (before, reopened)
        assert [r.message.payload for r in replay(storage, "#")] == [b"kept"]
    finally:
        storage.close()


def test_dropping_a_generation_still_in_memtables_frees_its_write_ahead_log(tmp_path: Path, engine: Engine) -> None:
    """A generation dropped before anything was flushed: its writes sit in RocksDB's WAL only.

    The WAL files are deleted once every column family with writes in them
    has flushed, and the metadata family takes a write with every batch; so
    without a flush of the other families a drop freed nothing until 64 MiB
    of WAL forced one (a node past its disk quota stayed past it).
    """
    path = str(tmp_path / "s")
    storage = ShardStorage(path, 0, engine)
    try:
        payload_bytes = _big_first_generation(storage)
        before = dir_size(path)
        assert before > payload_bytes
        storage.drop_generation(1)
        deadline = time.monotonic() + 10
        while dir_size(path) > before - payload_bytes * 0.9 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dir_size(path) < before - payload_bytes * 0.9, (before, dir_size(path))
        assert [r.message.payload for r in replay(storage, "#")] == [b"kept"]
    finally:
        storage.close()


# -- restart -------------------------------------------------------------------


def test_restart_restores_everything(tmp_path: Path, engine: Engine) -> None:
    path = str(tmp_path / "s")
    storage = ShardStorage(path, 7, engine, lts_threshold_top=2, lts_threshold=2)
    storage.initialize(5, applied_index=1)
    storage.store([msg(f"r/{i}/v", str(i).encode()) for i in range(6)], 100, applied_index=2)
    storage.add_generation(200, applied_index=3)
    storage.store([msg(f"r/{i}/v", str(i).encode(), qos=1) for i in range(6)], 300, sync=True)
    storage.store([msg("$SYS/up"), msg("top1"), msg("top2")], 400)
    storage.record_applied(9)
    wild = next(r for r in storage.get_streams(["r", "4", "v"], 0) if r.pattern == "r/+/v" and r.generation == 2)
    state = storage.make_iterator(2, wild.stream, "r/+/v", 0)
    first = storage.next(state, 2)
    saved = first.state.encode()
    before = {
        "generations": storage.generations(),
        "last_ts": storage.last_ts,
        "streams": storage.trie.streams(),
        "patterns": [storage.trie.pattern(s) for s in storage.trie.streams()],
        "next_node": storage.trie.next_node,
        "dump": list(storage.dump()),
        "replay": [(r.ref, r.message) for r in replay(storage, "#")],
    }
    rest, _, _ = drain(storage, first.state, 100)
    storage.close()

    # Thresholds come from the database, not from the arguments, once it exists.
    storage = ShardStorage(path, 7, engine, lts_threshold_top=50, lts_threshold=50)
    try:
        assert (storage.trie.threshold_top, storage.trie.threshold) == (2, 2)
        assert storage.generations() == before["generations"]
        assert storage.current_generation == 2
        assert storage.last_ts == before["last_ts"]
        assert storage.applied_index == 9
        assert storage.trie.streams() == before["streams"]
        assert [storage.trie.pattern(s) for s in storage.trie.streams()] == before["patterns"]
        assert storage.trie.next_node == before["next_node"]
        assert list(storage.dump()) == before["dump"]
        assert [(r.ref, r.message) for r in replay(storage, "#")] == before["replay"]
        # An iterator saved before the restart continues where it was.
        resumed, _, _ = drain(storage, IteratorState.decode(saved), 100)
        assert resumed == rest and len(resumed) == 2
        # Topics keep their streams, and new timestamps keep increasing.
        assert storage.initialize(10**9).generation == 2
        ts = storage.store([msg("r/9/v", b"after")], 1)
        assert ts == before["last_ts"] + 1
        assert {r.ref.stream for r in replay(storage, "r/9/v")} == {wild.stream}
        assert len(storage.trie.streams()) == len(before["streams"])
    finally:
        storage.close()


def test_reopening_with_another_shard_number_is_refused(tmp_path: Path, engine: Engine) -> None:
    path = str(tmp_path / "s")
    ShardStorage(path, 1, engine).close()
    with pytest.raises(MqdsError) as info:
        ShardStorage(path, 2, engine)
    assert info.value.reason is Reason.STORAGE_ERROR
    assert "holds shard 1, not shard 2" in info.value.message


def test_unknown_format_version_is_refused(tmp_path: Path, engine: Engine) -> None:
    path = str(tmp_path / "s")
    ShardStorage(path, 0, engine).close()
    db = Rdict(path, engine.db_options())
    db[keys.META_FORMAT] = keys.u16(3)
    db.close()
    with pytest.raises(MqdsError) as info:
        ShardStorage(path, 0, engine)
    assert info.value.reason is Reason.STORAGE_ERROR
    assert "format version 3 is not supported" in info.value.message


def test_orphan_generation_column_families_are_dropped_on_open(tmp_path: Path, engine: Engine) -> None:
    path = str(tmp_path / "s")
    storage = ShardStorage(path, 0, engine)
    storage.initialize(1)
    storage.store([msg("o", b"1")], 10)
    storage.add_generation(20)
    before = list(storage.dump())
    storage.close()
    names = Rdict.list_cf(path)
    db = Rdict(path, engine.db_options(), column_families={n: engine.cf_options() for n in names if n != "default"})
    orphan = db.create_column_family(keys.generation_cf(3), engine.cf_options())
    orphan[keys.data_key(1, 1)] = b"junk"
    del orphan
    db.close()
    assert keys.generation_cf(3) in Rdict.list_cf(path)
    storage = ShardStorage(path, 0, engine)
    try:
        assert [g.generation for g in storage.generations()] == [1, 2]
        assert list(storage.dump()) == before
        assert storage.add_generation(30).generation == 3  # the name is free again
        assert [r.message.payload for r in replay(storage, "#")] == [b"1"]
    finally:
        storage.close()
    assert keys.generation_cf(3) in Rdict.list_cf(path)


# -- determinism ---------------------------------------------------------------


def _script(storage: ShardStorage, encoded: bool = False) -> None:
    """Stores with a clock that jumps both ways, rotations and drops, each with its log index.

    ``encoded``: pass each message's encoding too, as a replica applying a logged command does.
    """
    rng = random.Random(99)
    storage.initialize(3, applied_index=1)
    index = 2
    for step in range(60):
        if step % 12 == 5:
            storage.add_generation(rng.randint(0, 50_000), applied_index=index)
        elif step % 12 == 11 and len(storage.generations()) > 2:
            storage.drop_generation(storage.generations()[0].generation, applied_index=index)
        else:
            batch = [random_message(rng) for _ in range(rng.randint(0, 6))]
            values = [m.SerializeToString() for m in batch] if encoded else None
            storage.store(batch, rng.randint(0, 50_000), applied_index=index, encoded=values)
        index += 1


def test_same_calls_give_identical_content(tmp_path: Path, engine: Engine) -> None:
    a = ShardStorage(str(tmp_path / "a"), 4, engine, lts_threshold_top=3, lts_threshold=2)
    b = ShardStorage(str(tmp_path / "b"), 4, engine, lts_threshold_top=3, lts_threshold=2)
    try:
        _script(a)
        # Stored through the logged encodings (as replicas do) or encoded again: the same content.
        _script(b, encoded=True)
        dump_a = list(a.dump())
        assert dump_a == list(b.dump())
        assert {cf for cf, _, _ in dump_a} >= {"default", keys.generation_cf(a.current_generation)}
        assert sum(1 for cf, _, _ in dump_a if cf != "default") > 100
        assert a.generations() == b.generations()
        assert a.current_generation == 6 and a.generations()[0].generation > 1  # some were dropped
        assert a.applied_index == b.applied_index == 61
        # The content is stable across a restart too.
        b.close()
        b = ShardStorage(str(tmp_path / "b"), 4, engine)
        assert list(b.dump()) == dump_a
    finally:
        a.close()
        b.close()


def test_different_calls_give_different_content(tmp_path: Path, engine: Engine) -> None:
    a = ShardStorage(str(tmp_path / "a"), 0, engine)
    b = ShardStorage(str(tmp_path / "b"), 0, engine)
    try:
        for storage, now in ((a, 10), (b, 11)):
            storage.initialize(1)
            storage.store([msg("d")], now)
        assert list(a.dump()) != list(b.dump())
    finally:
        a.close()
        b.close()


# -- failures half-way -------------------------------------------------------


def test_a_failed_store_does_not_lose_later_messages_after_restart(tmp_path: Path, engine: Engine) -> None:
    path = str(tmp_path / "s")
    storage = ShardStorage(path, 0, engine)
    storage.initialize(1)
    assert store_failing(storage, [msg("a/b", b"lost")], 10) is Reason.STORAGE_ERROR
    storage.store([msg("a/b", b"kept")], 20, sync=True)
    assert [r.message.payload for r in replay(storage, "a/b")] == [b"kept"]
    storage.close()
    storage = ShardStorage(path, 0, engine)
    try:
        assert [r.message.payload for r in replay(storage, "a/b")] == [b"kept"]
    finally:
        storage.close()


def test_a_failed_store_never_mixes_topics_after_restart(tmp_path: Path, engine: Engine) -> None:
    path = str(tmp_path / "s")
    storage = ShardStorage(path, 0, engine)
    storage.initialize(1)
    assert store_failing(storage, [msg("a/b", b"first try")], 10) is Reason.STORAGE_ERROR
    storage.store([msg("a/b", b"a/b message")], 20)
    storage.close()
    storage = ShardStorage(path, 0, engine)
    try:
        storage.store([msg("c/d", b"c/d message")], 30)
        reads = replay(storage, "c/d")
        assert [r.message.topic for r in reads] == ["c/d"], [(r.message.topic, r.message.payload) for r in reads]
    finally:
        storage.close()


def test_add_generation_can_be_retried_after_a_failed_write(tmp_path: Path, engine: Engine) -> None:
    storage = ShardStorage(str(tmp_path / "s"), 0, engine)
    storage.initialize(1)
    try:
        reason = None
        with failing_writes(storage):
            try:
                storage.add_generation(50)
            except MqdsError as err:
                reason = err.reason
        assert reason is Reason.STORAGE_ERROR
        assert storage.current_generation == 1
        assert [g.current for g in storage.generations()] == [True]
        try:
            retried = storage.add_generation(60)
        except Exception as err:
            raise AssertionError(f"retrying add_generation failed: {type(err).__name__}: {err}") from err
        assert retried.generation == 2
    finally:
        storage.close()


def test_topics_with_more_than_256_varying_levels_can_be_stored(tmp_path: Path, engine: Engine) -> None:
    storage = ShardStorage(str(tmp_path / "s"), 0, engine, lts_threshold_top=1, lts_threshold=1)
    storage.initialize(1)
    try:
        depth = 260
        # With thresholds of 1, the k-th distinct topic 'vk/vk/...' has k varying levels.
        for k in range(depth):
            topic = "/".join([f"v{k}"] * depth)
            storage.store([msg(topic, str(k).encode())], 10 + k)
        last = "/".join([f"v{depth - 1}"] * depth)
        assert [r.message.payload for r in replay(storage, last)] == [str(depth - 1).encode()]
        # A filter that fixes only a level beyond the indexed ones scans and checks topics.
        deep = "/".join(["+"] * 200 + [f"v{depth - 1}"] + ["+"] * (depth - 201))
        assert [r.message.payload for r in replay(storage, deep)] == [str(depth - 1).encode()]
    finally:
        storage.close()

"""The storage layer of one shard: timestamps, replay, iterators, generations, restarts, the index, key layout."""

from __future__ import annotations

import itertools
import os
import random
import struct
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rocksdict import Rdict, WriteBatch

from mqds.protocol.errors import (
    FailedPreconditionError,
    GenerationDroppedError,
    InvalidArgumentError,
    MqdsError,
    NotFoundError,
    Reason,
)
from mqds.protocol.topics import matches, validate_filter
from mqds.server.storage import keys
from mqds.server.storage.iterators import IteratorDecodeError, IteratorState
from mqds.server.storage.shard import (
    Engine,
    EngineOptions,
    GenerationInfo,
    ShardStorage,
    StreamRef,
    decode_message,
    encode_messages,
    message_wire,
    repeated_field,
    varint,
)
from mqds.v1 import storage_pb2 as pb


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine()


@pytest.fixture
def shard(tmp_path: Path, engine: Engine) -> Iterator[ShardStorage]:
    storage = ShardStorage(str(tmp_path / "shard"), 0, engine)
    storage.initialize(1)
    yield storage
    storage.close()


def msg(
    topic: str,
    payload: bytes = b"",
    sender: str = "client-1",
    qos: int = 0,
    retain: bool = False,
    properties: Sequence[tuple[str, str]] = (),
) -> pb.Message:
    return pb.Message(
        topic=topic,
        payload=payload,
        sender=sender,
        qos=qos,
        retain=retain,
        properties=[pb.UserProperty(key=k, value=v) for k, v in properties],
    )


def stamped(message: pb.Message, ts: int, shard: int) -> pb.Message:
    out = pb.Message()
    out.CopyFrom(message)
    out.timestamp_us = ts
    out.shard = shard
    return out


def drain(
    storage: ShardStorage, state: IteratorState, batch_size: int, *, reencode: bool = False
) -> tuple[list[tuple[int, bytes]], IteratorState, bool]:
    """Read an iterator until an empty batch or end_of_stream; optionally round-trip the state each time."""
    entries: list[tuple[int, bytes]] = []
    for _ in range(100_000):
        result = storage.next(state, batch_size)
        assert len(result.entries) <= batch_size
        entries += result.entries
        state = IteratorState.decode(result.state.encode()) if reencode else result.state
        if result.end_of_stream or not result.entries:
            return entries, state, result.end_of_stream
    raise AssertionError("iterator never ended")


@dataclass(frozen=True)
class Read:
    ref: StreamRef
    ts: int
    message: pb.Message


def replay(storage: ShardStorage, topic_filter: str, start_time_us: int = 0, batch_size: int = 5) -> list[Read]:
    """Read every stream get_streams returns for the filter, checking the per-stream invariants."""
    out: list[Read] = []
    refs = storage.get_streams(validate_filter(topic_filter), start_time_us)
    assert refs == sorted(refs, key=lambda r: (r.generation, r.stream)), "streams not by generation, then id"
    assert len({(r.generation, r.stream) for r in refs}) == len(refs)
    current = storage.current_generation
    for ref in refs:
        assert ref.pattern == storage.trie.pattern(ref.stream)
        state = storage.make_iterator(ref.generation, ref.stream, topic_filter, start_time_us)
        assert state == IteratorState(storage.shard, ref.generation, ref.stream, topic_filter, start_time_us)
        entries, state, end = drain(storage, state, batch_size)
        # end_of_stream only in a closed generation, and a closed one does end.
        assert end is (ref.generation != current), (ref, end)
        if ref.generation == current:
            again = storage.next(state, batch_size)
            assert again.entries == [] and again.end_of_stream is False
        stamps = [ts for ts, _ in entries]
        assert stamps == sorted(set(stamps)), f"stream {ref} out of timestamp order"
        for ts, stored in entries:
            message = decode_message(stored, ts, storage.shard)
            assert matches(ref.pattern, message.topic), f"{message.topic!r} is in stream {ref}"
            out.append(Read(ref, ts, message))
    return out


@contextmanager
def failing_writes(storage: ShardStorage) -> Iterator[None]:
    """Make the shard's RocksDB writes fail (as with a full disk) inside the block."""

    class Failing:
        def __init__(self, db: Rdict) -> None:
            self._db = db

        def write(self, *args: object, **kwargs: object) -> None:
            raise OSError("IO error: No space left on device")

        def __getattr__(self, name: str) -> object:
            return getattr(self._db, name)

    real = storage._db
    storage._db = Failing(real)
    try:
        yield
    finally:
        storage._db = real


def store_failing(storage: ShardStorage, messages: list[pb.Message], now_us: int) -> Reason | None:
    """Store while writes fail; the reason of the error, or None if it did not fail.

    The exception is not kept: its traceback would hold column family handles, and RocksDB
    stays locked until they are released.
    """
    with failing_writes(storage):
        try:
            storage.store(messages, now_us)
        except MqdsError as err:
            return err.reason
    return None


def dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


# -- initialisation ------------------------------------------------------------


def test_initialize_creates_generation_one_once(tmp_path: Path, engine: Engine) -> None:
    storage = ShardStorage(str(tmp_path / "s"), 5, engine)
    try:
        assert storage.generations() == []
        info = storage.initialize(1_000)
        assert info == GenerationInfo(shard=5, generation=1, since_us=0, until_us=None, created_at_us=1_000)
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


# -- replay --------------------------------------------------------------------

LEVELS = ["a", "b", "c", "", "$SYS", "x1", "x2", "x3", "x4"]
SHARD_NO = 3


@dataclass(frozen=True)
class Dataset:
    storage: ShardStorage
    stored: list[pb.Message]  # as replay returns them: with timestamp_us and shard


def _random_topic(rng: random.Random) -> str:
    while True:
        depth = rng.randint(1, 3)
        topic = "/".join(rng.choice(LEVELS) for _ in range(depth))
        if topic:
            return topic


def _random_message(rng: random.Random) -> pb.Message:
    props = [(rng.choice(["k", "k", "unit", "é"]), rng.choice(["v", "", "°C"])) for _ in range(rng.randint(0, 3))]
    return msg(
        _random_topic(rng),
        payload=rng.randbytes(rng.randint(0, 40)),
        sender=f"client-{rng.randint(0, 4)}",
        qos=rng.randint(0, 2),
        retain=rng.random() < 0.3,
        properties=props,
    )


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory, engine: Engine) -> Iterator[Dataset]:
    """Three generations (two closed) of varied messages in a shard with small thresholds."""
    rng = random.Random(20240611)
    storage = ShardStorage(
        str(tmp_path_factory.mktemp("dataset")), SHARD_NO, engine, lts_threshold_top=3, lts_threshold=2
    )
    storage.initialize(1)
    stored: list[pb.Message] = []
    now = 1_000
    for generation in range(3):
        for _ in range(25):
            batch = [_random_message(rng) for _ in range(rng.randint(1, 8))]
            now += rng.randint(-50, 100)  # the clock may go backwards
            first = storage.store(batch, now)
            stored += [stamped(m, first + k, SHARD_NO) for k, m in enumerate(batch)]
        if generation < 2:
            now += 10
            storage.add_generation(now)
    assert storage.current_generation == 3
    yield Dataset(storage, stored)
    storage.close()


def _expected(data: Dataset, topic_filter: str, start: int = 0) -> list[pb.Message]:
    return [m for m in data.stored if matches(topic_filter, m.topic) and m.timestamp_us >= start]


def _check_replay(data: Dataset, topic_filter: str, start: int, batch_size: int) -> list[Read]:
    reads = replay(data.storage, topic_filter, start, batch_size)
    got = sorted(reads, key=lambda r: r.ts)
    assert [r.message for r in got] == _expected(data, topic_filter, start), topic_filter
    for read in reads:
        assert read.message.timestamp_us == read.ts
        assert matches(topic_filter, read.message.topic)
    return reads


def test_dataset_has_wildcard_streams_and_dollar_topics(dataset: Dataset) -> None:
    patterns = {dataset.storage.trie.pattern(s) for s in dataset.storage.trie.streams()}
    assert any("+" in p for p in patterns)
    assert any(p.startswith("$SYS") for p in patterns)
    assert any(m.topic.startswith("$SYS") for m in dataset.stored)
    assert len({m.topic for m in dataset.stored}) > 50
    assert len(dataset.stored) > 300
    gens = dataset.storage.generations()
    assert [g.current for g in gens] == [False, False, True]


@pytest.mark.parametrize(
    "topic_filter",
    ["#", "+", "+/+", "a", "a/#", "a/+", "+/b/#", "/#", "+//+", "$SYS/#", "$SYS/+", "+/#", "x1/x2/x3", "x4/+/a", "c/"],
)
@pytest.mark.parametrize("batch_size", [1, 4, 1000])
def test_replay_returns_exactly_the_matching_messages(dataset: Dataset, topic_filter: str, batch_size: int) -> None:
    _check_replay(dataset, topic_filter, 0, batch_size)


def test_replay_of_everything_returns_every_field(dataset: Dataset) -> None:
    reads = _check_replay(dataset, "#", 0, 50)
    reads += _check_replay(dataset, "$SYS/#", 0, 50)
    assert sorted((r.message for r in reads), key=lambda m: m.timestamp_us) == dataset.stored
    assert {r.message.qos for r in reads} == {0, 1, 2}
    assert {r.message.retain for r in reads} == {False, True}
    assert any(len(r.message.properties) >= 2 for r in reads)
    assert all(r.message.shard == SHARD_NO for r in reads)


filter_strategy = st.lists(st.sampled_from([*LEVELS, "+", "+"]), min_size=0, max_size=3).flatmap(
    lambda levels: st.sampled_from(
        ["/".join([*levels, "#"])] + (["/".join(levels)] if levels and levels != [""] else [])
    )
)


@settings(max_examples=60, deadline=None)
@given(filter_strategy, st.integers(0, 3_000), st.integers(1, 9))
def test_replay_property_any_filter_any_start(dataset: Dataset, topic_filter: str, start: int, batch: int) -> None:
    _check_replay(dataset, topic_filter, start, batch)


def test_properties_keep_duplicates_and_order(shard: ShardStorage) -> None:
    props = [("k", "1"), ("a", "x"), ("k", "1"), ("k", "0"), ("", ""), ("é", "ü")]
    payload = bytes(range(256))
    original = msg("p/q", payload, sender="pub-ü", qos=2, retain=True, properties=props)
    ts = shard.store([original, msg("p/q")], 77, sync=True)
    reads = replay(shard, "p/q")
    assert [r.ts for r in reads] == [ts, ts + 1]
    got = reads[0].message
    assert [(p.key, p.value) for p in got.properties] == props
    assert got.payload == payload
    assert (got.topic, got.sender, got.qos, got.retain) == ("p/q", "pub-ü", 2, True)
    assert (got.timestamp_us, got.shard) == (ts, 0)
    assert got == stamped(original, ts, 0)
    assert reads[1].message == stamped(msg("p/q"), ts + 1, 0)


@pytest.mark.parametrize("shard_no", [0, 1, 127, 128, 16_383, 16_384, 2**32 - 1])
def test_decode_message_and_wire_encodings(shard_no: int) -> None:
    original = msg("a/b", b"\x00" * 20_000, sender="s", qos=1, properties=[("k", "v")])
    stored = original.SerializeToString()
    ts = 1_700_000_000_123_456
    expected = stamped(original, ts, shard_no)
    assert decode_message(stored, ts, shard_no) == expected
    assert pb.Message.FromString(message_wire(stored, ts, shard_no)) == expected
    small = msg("c", b"x")
    body = encode_messages(b"\x0a", [(ts, stored), (ts + 1, small.SerializeToString())], shard_no)
    token = pb.IteratorToken(shard=shard_no, generation=2, state=b"st")
    body += repeated_field(b"\x12", [token.SerializeToString()])
    response = pb.NextResponse.FromString(body)
    assert list(response.messages) == [expected, stamped(small, ts + 1, shard_no)]
    assert response.iterator == token


@pytest.mark.parametrize("value", [1, 127, 128, 300, 16_383, 16_384, 2**21, 2**32 - 1, 2**63])
def test_varint_matches_protobuf(value: int) -> None:
    encoded = pb.MessagePosition(timestamp_us=value).SerializeToString()
    assert encoded == b"\x10" + varint(value)


# -- iterators -----------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 2, 3, 7, 40, 1000])
@pytest.mark.parametrize("topic_filter", ["s/+/t", "s/7/t", "s/7/#", "s/1/t", "#"])
def test_resuming_from_encoded_state_has_no_gaps_or_repeats(
    tmp_path: Path, engine: Engine, batch_size: int, topic_filter: str
) -> None:
    storage = ShardStorage(str(tmp_path / "s"), 0, engine, lts_threshold=3)
    storage.initialize(1)
    try:
        for r in range(12):
            storage.store([msg(f"s/{i}/t", f"{r}:{i}".encode()) for i in range(10)], 100 * r)
        storage.store([msg("other", b"o")], 0)
        for ref in storage.get_streams(topic_filter.split("/"), 0):
            start = storage.make_iterator(ref.generation, ref.stream, topic_filter, 0)
            full, _, _ = drain(storage, start, 10_000)
            pieces, _, _ = drain(storage, start, batch_size, reencode=True)
            assert pieces == full
            stamps = [ts for ts, _ in pieces]
            assert stamps == sorted(set(stamps))
        got = sorted(r.message.payload for r in replay(storage, topic_filter, 0, batch_size))
        expected = sorted(
            f"{r}:{i}".encode() for r in range(12) for i in range(10) if matches(topic_filter, f"s/{i}/t")
        ) + ([b"o"] if topic_filter == "#" else [])
        assert got == sorted(expected)
    finally:
        storage.close()


@pytest.mark.parametrize("topic_filter", ["live/+", "live/5", "live/#"])
def test_tailing_the_current_generation_then_rotation(tmp_path: Path, engine: Engine, topic_filter: str) -> None:
    storage = ShardStorage(str(tmp_path / "s"), 0, engine, lts_threshold=2)
    storage.initialize(1)
    try:
        storage.store([msg(f"live/{i}", b"first") for i in range(6)], 10)
        wild = [r for r in storage.get_streams(["live", "5"], 0) if r.pattern == "live/+"]
        assert len(wild) == 1
        state = storage.make_iterator(1, wild[0].stream, topic_filter, 0)
        entries, state, end = drain(storage, state, 3)
        expected = 4 if topic_filter != "live/5" else 1
        assert len(entries) == expected and not end
        # In the current generation an empty batch means "nothing yet", again and again.
        for _ in range(3):
            result = storage.next(state, 3)
            assert result.entries == [] and result.end_of_stream is False
            assert result.state == state
        storage.store([msg("live/5", b"second"), msg("live/0", b"literal")], 20)
        result = storage.next(state, 10)
        assert [decode_message(v, ts, 0).payload for ts, v in result.entries] == [b"second"]
        assert result.end_of_stream is False
        state = result.state
        storage.store([msg("live/5", b"third")], 30)
        storage.add_generation(40)
        storage.store([msg("live/5", b"next generation")], 50)
        # The old generation is closed: the rest comes, then end_of_stream, which stays.
        entries, state, end = drain(storage, state, 1)
        assert [decode_message(v, ts, 0).payload for ts, v in entries] == [b"third"]
        assert end is True
        for _ in range(2):
            result = storage.next(state, 5)
            assert result.entries == [] and result.end_of_stream is True
        # A fresh iterator over the closed generation also ends.
        entries, _, end = drain(storage, storage.make_iterator(1, wild[0].stream, topic_filter, 0), 100)
        assert end is True
        assert len(entries) == expected + 2
    finally:
        storage.close()


def test_end_of_stream_can_come_with_the_last_batch(shard: ShardStorage) -> None:
    shard.store([msg("e", bytes([i])) for i in range(4)], 10)
    shard.add_generation(100)
    state = shard.make_iterator(1, shard.trie.streams()[0], "e", 0)
    first = shard.next(state, 2)
    assert len(first.entries) == 2 and first.end_of_stream is False
    last = shard.next(first.state, 2)
    assert len(last.entries) == 2 and last.end_of_stream is True


def test_concurrent_reader_sees_every_message_once_and_ends_only_after_rotation(tmp_path: Path, engine: Engine) -> None:
    storage = ShardStorage(str(tmp_path / "s"), 0, engine, lts_threshold=1)
    storage.initialize(1)
    try:
        storage.store([msg("live/0", b"seed"), msg("live/x", b"x-seed")], 1)
        wild = next(r for r in storage.get_streams(["live", "+"], 0) if r.pattern == "live/+")
        states = {
            "all": storage.make_iterator(1, wild.stream, "live/+", 0),
            "one": storage.make_iterator(1, wild.stream, "live/x", 0),
        }
        written: list[pb.Message] = [msg("live/x", b"x-seed")]
        errors: list[BaseException] = []

        def writer() -> None:
            try:
                for i in range(1_500):
                    batch = [msg(f"live/{'x' if j == 0 else f'y{i % 7}'}", f"{i}.{j}".encode()) for j in range(4)]
                    storage.store(batch, 10 + i)
                    written.extend(batch)
                    time.sleep(0)  # let the reader in between batches
                storage.add_generation(1_000)
                storage.store([msg("live/x", b"too late")], 1_001)
            except BaseException as err:
                errors.append(err)

        thread = threading.Thread(target=writer)
        thread.start()
        got: dict[str, list[tuple[int, bytes]]] = {name: [] for name in states}
        ended: set[str] = set()
        deadline = time.monotonic() + 30
        while len(ended) < len(states) and time.monotonic() < deadline:
            for name, state in states.items():
                if name in ended:
                    continue
                result = storage.next(state, 5)
                got[name] += result.entries
                states[name] = result.state
                if result.end_of_stream:
                    ended.add(name)
                elif not result.entries:
                    time.sleep(0)  # caught up with the writer
        thread.join()
        assert not errors
        assert ended == set(states)
        all_payloads = [decode_message(v, ts, 0).payload for ts, v in got["all"]]
        assert all_payloads == [m.payload for m in written]
        x_payloads = [decode_message(v, ts, 0).payload for ts, v in got["one"]]
        assert x_payloads == [m.payload for m in written if m.topic == "live/x"]
        assert b"too late" not in all_payloads
    finally:
        storage.close()


# -- generations ---------------------------------------------------------------


def test_add_generation_closes_the_old_one(shard: ShardStorage) -> None:
    shard.store([msg("g/a", b"1")], 100)
    info = shard.add_generation(500)
    assert info == GenerationInfo(0, 2, since_us=500, until_us=None, created_at_us=500)
    gens = shard.generations()
    assert gens[0] == GenerationInfo(0, 1, since_us=0, until_us=500, created_at_us=1)
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


def test_dropping_a_generation_frees_its_disk(tmp_path: Path, engine: Engine) -> None:
    path = str(tmp_path / "s")
    storage = ShardStorage(path, 0, engine)
    storage.initialize(1)
    payload_bytes = 4 * 1024 * 1024
    for i in range(64):
        storage.store([msg(f"big/{i % 4}", os.urandom(payload_bytes // 64))], 10 + i)
    storage.add_generation(1_000)
    storage.store([msg("small", b"kept")], 1_001)
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
            batch = [_random_message(rng) for _ in range(rng.randint(0, 6))]
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


# -- the index -----------------------------------------------------------------


def test_index_reads_only_the_wanted_sensor(tmp_path: Path, engine: Engine) -> None:
    storage = ShardStorage(str(tmp_path / "s"), 0, engine)  # default thresholds
    storage.initialize(1)
    try:
        order = [(sensor, k) for sensor in range(1_000) for k in range(20)]
        random.Random(42).shuffle(order)
        stored: list[pb.Message] = []
        for start in range(0, len(order), 500):
            batch = [
                msg(f"sensor/{s}/temp", f"{s}:{k}".encode(), sender=f"c{s}") for s, k in order[start : start + 500]
            ]
            first = storage.store(batch, 1_000 + start)
            stored += [stamped(m, first + i, 0) for i, m in enumerate(batch)]
        total = len(stored)
        assert total == 20_000
        patterns = sorted({storage.trie.pattern(s) for s in storage.trie.streams()})
        assert len(patterns) == 11 and "sensor/+/temp" in patterns

        for sensor in (42, 999, order[0][0]):
            storage.keys_read = 0
            reads = replay(storage, f"sensor/{sensor}/#", batch_size=100)
            wanted = [m for m in stored if m.topic == f"sensor/{sensor}/temp"]
            assert len(wanted) == 20
            assert sorted((r.message for r in reads), key=lambda m: m.timestamp_us) == wanted
            assert storage.keys_read <= 3 * len(wanted) + 5, storage.keys_read
            assert storage.keys_read < total // 100
        # The first sensor seen has a literal stream of its own.
        assert f"sensor/{order[0][0]}/temp" in patterns

        storage.keys_read = 0
        everything = replay(storage, "sensor/+/temp", batch_size=1_000)
        assert len(everything) == total
        assert storage.keys_read >= total
    finally:
        storage.close()


def _index_keys(storage: ShardStorage) -> list[tuple[bytes, bytes]]:
    gen = storage._gens[storage.current_generation]
    return [(k, v) for k, v in gen.cf.items(from_key=keys.INDEX_TAG) if k.startswith(keys.INDEX_TAG)]


def test_a_batch_writes_one_index_key_per_value_and_reads_resume_inside_it(tmp_path: Path, engine: Engine) -> None:
    storage = ShardStorage(str(tmp_path / "s"), 0, engine, lts_threshold_top=3, lts_threshold=2)
    storage.initialize(1)
    try:
        stored: list[pb.Message] = []
        for round_ in range(3):
            batch = [msg(f"plant/{i % 7}/m{i % 3}", f"{round_}:{i}".encode()) for i in range(600)]
            first = storage.store(batch, 1_000 + round_)
            stored += [stamped(m, first + i, 0) for i, m in enumerate(batch)]
        # Past the first few topics they share the stream plant/+/+, whose two
        # varying levels have 7 and 3 values: each batch writes an index key
        # per stream, level and value (a few dozen in all), where one per
        # message and level would be thousands.
        assert "plant/+/+" in {storage.trie.pattern(s) for s in storage.trie.streams()}
        index = _index_keys(storage)
        assert 0 < len(index) <= 3 * 30
        assert sum(len(keys.decode_postings(0, v)) for _, v in index) > 20 * len(index)
        for topic_filter in ("plant/4/#", "plant/+/m1", "plant/2/m2", "plant/#"):
            wanted = [m for m in stored if matches(topic_filter, m.topic)]
            for batch_size in (1, 7, 100, 5_000):
                reads = replay(storage, topic_filter, batch_size=batch_size)
                assert sorted((r.message for r in reads), key=lambda m: m.timestamp_us) == wanted
            # Starting inside a batch (and inside an index key's list) misses nothing before it.
            start = stored[901].timestamp_us
            reads = replay(storage, topic_filter, start_time_us=start, batch_size=3)
            got = sorted((r.message for r in reads), key=lambda m: m.timestamp_us)
            assert got == [m for m in wanted if m.timestamp_us >= start], topic_filter
    finally:
        storage.close()


def test_a_database_with_one_index_key_per_message_reads_the_same_and_is_upgraded(
    tmp_path: Path, engine: Engine
) -> None:
    path = str(tmp_path / "s")
    storage = ShardStorage(path, 0, engine, lts_threshold_top=3, lts_threshold=2)
    storage.initialize(1)
    stored: list[pb.Message] = []
    batch = [msg(f"room/{i % 4}/t", str(i).encode()) for i in range(40)]
    first = storage.store(batch, 1_000)
    stored += [stamped(m, first + i, 0) for i, m in enumerate(batch)]
    # Rewrite the index as format 1 wrote it: one key per message, empty values.
    gen = storage._gens[storage.current_generation]
    old = WriteBatch(raw_mode=True)
    lists = _index_keys(storage)
    assert any(value for _, value in lists)
    for key, value in lists:
        prefix, ts = key[: keys.INDEX_PREFIX_LEN], keys.read_u64(key[keys.INDEX_PREFIX_LEN :])
        old.delete(key, gen.handle)
        for stamp in keys.decode_postings(ts, value):
            old.put(keys.index_key(prefix, stamp), b"", gen.handle)
    old.put(keys.META_FORMAT, keys.u16(1), storage.meta_handle)
    storage._db.write(old)
    del gen, old
    storage.close()

    storage = ShardStorage(path, 0, engine, lts_threshold_top=3, lts_threshold=2)
    try:
        assert keys.read_u16(storage.meta_get(keys.META_FORMAT) or b"") == keys.FORMAT_VERSION
        assert not any(value for _, value in _index_keys(storage))
        more = [msg(f"room/{i % 4}/t", f"new {i}".encode()) for i in range(12)]
        first = storage.store(more, 2_000)
        stored += [stamped(m, first + i, 0) for i, m in enumerate(more)]
        for topic_filter in ("room/2/#", "room/+/t", "#"):
            for batch_size in (1, 5, 100):
                reads = replay(storage, topic_filter, batch_size=batch_size)
                got = sorted((r.message for r in reads), key=lambda m: m.timestamp_us)
                assert got == [m for m in stored if matches(topic_filter, m.topic)], (topic_filter, batch_size)
    finally:
        storage.close()


def test_posting_lists_round_trip_and_damage_is_named() -> None:
    assert keys.encode_postings([5]) == b""
    assert keys.decode_postings(77, b"") == [77]
    positions = [3, 4, 10, 999, 70_000]
    assert keys.decode_postings(1_000_003, keys.encode_postings(positions)) == [1_000_000 + p for p in positions]
    with pytest.raises(ValueError, match="not a posting list"):
        keys.decode_postings(1, b"\x02" + bytes(8))
    with pytest.raises(ValueError, match="not a posting list"):
        keys.decode_postings(1, keys.encode_postings([1, 2])[:-1])


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


# -- keys ----------------------------------------------------------------------


def test_integer_codecs_round_trip() -> None:
    for value in (0, 1, 255, 256, 65_535):
        assert keys.read_u16(keys.u16(value)) == value
    for value in (0, 1, 2**32 - 1):
        assert keys.read_u32(keys.u32(value)) == value
    for value in (0, 1, 2**64 - 1):
        assert keys.read_u64(keys.u64(value)) == value
    assert keys.u32(1) == b"\x00\x00\x00\x01"


u32s = st.integers(0, 2**32 - 1)
u64s = st.integers(0, 2**64 - 1)


@settings(max_examples=200, deadline=None)
@given(u32s, u64s, u32s, u64s)
def test_data_keys_sort_by_stream_then_timestamp(s1: int, t1: int, s2: int, t2: int) -> None:
    k1, k2 = keys.data_key(s1, t1), keys.data_key(s2, t2)
    assert len(k1) == keys.DATA_KEY_LEN
    assert keys.parse_data_key(k1) == (s1, t1)
    assert (k1 < k2) is ((s1, t1) < (s2, t2))
    assert k1.startswith(keys.data_prefix(s1))
    assert k1 == keys.data_prefix(s1) + t1.to_bytes(8, "big")


@settings(max_examples=100, deadline=None)
@given(u32s, st.integers(0, keys.MAX_INDEXED_LEVELS - 1), st.text(max_size=20), u64s, u64s)
def test_index_keys(stream: int, level: int, value: str, t1: int, t2: int) -> None:
    prefix = keys.index_prefix(stream, level, value)
    assert len(prefix) == keys.INDEX_PREFIX_LEN
    assert prefix[:1] == keys.INDEX_TAG and prefix[1:5] == keys.u32(stream) and prefix[5] == level
    assert prefix[6:] == keys.level_hash(value)
    assert keys.index_key(prefix, t1)[len(prefix) :] == keys.u64(t1)
    assert (keys.index_key(prefix, t1) < keys.index_key(prefix, t2)) is (t1 < t2)


def test_levels_beyond_the_indexed_ones_have_no_index_keys() -> None:
    with pytest.raises(ValueError, match="not indexed"):
        keys.index_prefix(1, keys.MAX_INDEXED_LEVELS, "x")


def test_level_hash_is_blake2b_8() -> None:
    import hashlib

    assert keys.level_hash("42") == hashlib.blake2b(b"42", digest_size=8).digest()
    assert keys.level_hash("") != keys.level_hash("0")
    assert len(keys.level_hash("é" * 100)) == 8


@settings(max_examples=200, deadline=None)
@given(u32s, st.text(min_size=1, max_size=20).filter(lambda t: "\x00" not in t and "/" not in t))
def test_trie_edge_keys_round_trip(parent: int, token: str) -> None:
    key = keys.trie_edge_key(parent, token)
    assert key.startswith(keys.TRIE_PREFIX)
    assert keys.parse_trie_edge_key(key) == (parent, token)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 2), u32s)
def test_presence_keys_of_a_generation_form_one_range(generation: int, stream: int) -> None:
    key = keys.presence_key(generation, stream)
    assert keys.parse_presence_key(key) == (generation, stream)
    # drop_generation deletes [presence_key(g, 0), presence_key(g + 1, 0)).
    assert keys.presence_key(generation, 0) <= key < keys.presence_key(generation + 1, 0)
    if generation > 0:
        assert keys.presence_key(generation - 1, 2**32 - 1) < keys.presence_key(generation, 0)


def test_generation_column_family_names() -> None:
    assert keys.generation_cf(1) == "gen-00000001"
    assert keys.generation_cf(123_456_789) == "gen-123456789"
    for n in (0, 1, 42, 99_999_999, 123_456_789):
        assert keys.parse_generation_cf(keys.generation_cf(n)) == n
    for name in ("default", "gen-", "gen-abc", "gen--1", "gen-1x", "generation-1"):
        assert keys.parse_generation_cf(name) is None
    assert sorted(keys.generation_cf(n) for n in (10, 9, 2)) == [keys.generation_cf(n) for n in (2, 9, 10)]


@settings(max_examples=200, deadline=None)
@given(u64s, st.one_of(st.none(), st.integers(1, 2**64 - 1)), u64s)
def test_generation_records_round_trip(since: int, until: int | None, created: int) -> None:
    record = keys.GenerationRecord(since_us=since, until_us=until, created_at_us=created)
    raw = record.encode()
    assert len(raw) == 25 and raw[0] == keys.GENERATION_RECORD_VERSION
    assert keys.GenerationRecord.decode(raw) == record


def test_generation_record_with_unknown_version_is_refused() -> None:
    raw = bytearray(keys.GenerationRecord(1, 2, 3).encode())
    raw[0] = 2
    with pytest.raises(ValueError, match="generation record version 2 is not supported"):
        keys.GenerationRecord.decode(bytes(raw))


# -- iterator encoding ---------------------------------------------------------

states = st.builds(
    IteratorState,
    shard=u32s,
    generation=u32s,
    stream=u32s,
    topic_filter=st.text(max_size=30).filter(lambda t: "\x00" not in t),
    next_ts=u64s,
)


@settings(max_examples=200, deadline=None)
@given(states)
def test_iterator_state_round_trips(state: IteratorState) -> None:
    raw = state.encode()
    assert raw[:3] == b"MQI" and raw[3] == 1
    assert IteratorState.decode(raw) == state
    assert state.advanced(7) == IteratorState(state.shard, state.generation, state.stream, state.topic_filter, 7)


@settings(max_examples=100, deadline=None)
@given(states, st.data())
def test_damaged_iterators_are_rejected(state: IteratorState, data: st.DataObject) -> None:
    raw = state.encode()
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(IteratorDecodeError):
        IteratorState.decode(raw[:cut])
    position = data.draw(st.integers(0, len(raw) - 1))
    bit = data.draw(st.integers(0, 7))
    flipped = bytearray(raw)
    flipped[position] ^= 1 << bit
    with pytest.raises(IteratorDecodeError):
        IteratorState.decode(bytes(flipped))


def _with_crc(body: bytes) -> bytes:
    return body + struct.pack(">I", zlib.crc32(body))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "iterator is 0 bytes, too short to be an mqds iterator"),
        (b"garbage", "iterator is 7 bytes, too short to be an mqds iterator"),
        (b"MQI\x01" + b"\x00" * 23, "27 bytes, too short"),
        (_with_crc(struct.pack(">3sBIIIQ", b"XYZ", 1, 0, 1, 2, 3) + b"#"), "bad magic bytes"),
        (_with_crc(struct.pack(">3sBIIIQ", b"MQI", 2, 0, 1, 2, 3) + b"#"), "format version 2 is not supported"),
        (_with_crc(struct.pack(">3sBIIIQ", b"MQI", 0, 0, 1, 2, 3) + b"#"), "format version 0 is not supported"),
        (struct.pack(">3sBIIIQ", b"MQI", 1, 0, 1, 2, 3) + b"#" + b"\x00\x00\x00\x00", "checksum mismatch"),
        (_with_crc(struct.pack(">3sBIIIQ", b"MQI", 1, 0, 1, 2, 3) + b"\xff\xfe"), "filter is not UTF-8"),
        (b"\x00" * 40, "bad magic bytes"),
    ],
)
def test_garbage_iterators_name_the_problem(raw: bytes, message: str) -> None:
    with pytest.raises(IteratorDecodeError) as info:
        IteratorState.decode(raw)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_iterator_with_empty_filter_and_exact_minimum_size_decodes() -> None:
    raw = _with_crc(struct.pack(">3sBIIIQ", b"MQI", 1, 9, 8, 7, 6))
    assert len(raw) == 28
    assert IteratorState.decode(raw) == IteratorState(9, 8, 7, "", 6)


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

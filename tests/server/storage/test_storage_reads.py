"""Reading a shard: replay of every matching stream, iterators across generations, the index."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rocksdict import Options, Rdict, WriteBatch
from storage_support import TOPIC_LEVELS, Read, drain, msg, random_message, replay, stamped

from mqds.client.batch import wire_times
from mqds.protocol.topics import matches
from mqds.server.storage import keys, reads
from mqds.server.storage.iterators import IteratorState
from mqds.server.storage.shard import (
    Engine,
    ShardStorage,
    decode_message,
    encode_messages,
    message_wire,
    repeated_field,
    varint,
)
from mqds.server.wire import encode_rows, times_field
from mqds.v1 import storage_pb2 as pb

# -- replay --------------------------------------------------------------------

LEVELS = TOPIC_LEVELS  # filters over the levels random_message draws topics from
SHARD_NO = 3


@dataclass(frozen=True)
class Dataset:
    storage: ShardStorage
    stored: list[pb.Message]  # as replay returns them: with timestamp_us and shard


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
            batch = [random_message(rng) for _ in range(rng.randint(1, 8))]
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


@pytest.mark.parametrize("shard_no", [0, 1, 127, 128, 2**32 - 1])
def test_rows_encode_to_the_same_answer_as_timestamped_entries(shard_no: int) -> None:
    """A Next answer built from the engine's rows (key, stored) is the one built from (timestamp, stored)."""
    stamps = [0, 1, 255, 256, 1_700_000_000_123_456, 2**64 - 1]
    sizes = [0, 1, 115, 116, 4_094, 4_095, 4_096, 20_000]
    entries = [(ts, msg("a/b", b"\x07" * size).SerializeToString()) for ts in stamps for size in sizes]
    rows = [(keys.data_key(9, ts), stored) for ts, stored in entries]
    body, times = encode_rows(b"\x0a", rows, shard_no)
    assert body == encode_messages(b"\x0a", entries, shard_no)
    answer = pb.NextResponse.FromString(body + times_field(b"\x22", times))
    got = answer.messages
    assert [(m.timestamp_us, m.shard, len(m.payload)) for m in got] == [
        (ts, shard_no, size) for ts in stamps for size in sizes
    ]
    # NextResponse.timestamps: the same timestamps, 8 bytes little-endian each, as the client reads them.
    assert list(wire_times(answer.timestamps)) == [m.timestamp_us for m in got]
    assert times_field(b"\x22", b"") == b""
    assert encode_rows(b"\x0a", [], shard_no) == (b"", b"")


@pytest.mark.parametrize("stream", [0, 7, 2**32 - 1])
def test_a_stream_scan_stops_at_its_own_keys_and_at_the_fence(tmp_path: Path, stream: int) -> None:
    """The scan's bounded iterator: never the next stream's keys (or the next key kind), nothing after the fence."""
    db = Rdict(str(tmp_path / "db"), Options(raw_mode=True))
    try:
        for ts in (5, 6, 9, 2**64 - 1):
            db[keys.data_key(stream, ts)] = msg("a", b"in").SerializeToString()
        if stream < 2**32 - 1:
            db[keys.data_key(stream + 1, 0)] = msg("a", b"next stream").SerializeToString()
        db[b"E"] = b"a key of the next kind"
        state = IteratorState(0, 1, stream, "#", 0)

        def scan(fence: int, batch: int = 10) -> tuple[list[int], int, bool]:
            rows, next_ts, exhausted = reads.scan_stream(db, state, batch, None, fence, None, reads.ReadCost())
            return [keys.data_key_ts(key) for key, _ in rows], next_ts, exhausted

        assert scan(reads.NO_FENCE) == ([5, 6, 9, 2**64 - 1], 2**64, True)
        assert scan(2**64 - 1) == ([5, 6, 9, 2**64 - 1], 2**64, True)
        assert scan(8) == ([5, 6], 7, True)
        assert scan(9) == ([5, 6, 9], 10, True)
        assert scan(4) == ([], 0, True)
        assert scan(reads.NO_FENCE, batch=2) == ([5, 6], 7, False)
    finally:
        db.close()


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


def _reference_take(rows: list[tuple[bytes, bytes]], batch: int, max_bytes: int | None) -> tuple[list[bytes], bool]:
    """The replay loop as it was, a row at a time: what the chunked scan must keep, and whether it ended."""
    kept: list[bytes] = []
    budget = reads.NO_FENCE if max_bytes is None else max_bytes
    for key, value in rows:
        if len(kept) == batch or (len(value) > budget and kept):
            return kept, False
        kept.append(key)
        budget -= len(value)
    return kept, True


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), max_size=300),
    batch=st.integers(1, 150),
    max_bytes=st.one_of(st.none(), st.integers(0, 20_000)),
)
def test_a_chunked_scan_keeps_what_the_row_loop_kept_and_reads_a_bounded_amount_past_it(
    sizes: list[int], batch: int, max_bytes: int | None
) -> None:
    """Batch size, byte budget (one row at least), end of stream: as before; past the cut, at most a chunk read."""
    rows = [(keys.data_key(3, 1000 + i), b"x" * size) for i, size in enumerate(sizes)]
    cost = reads.ReadCost()
    got, next_ts, exhausted = reads._take_rows(iter(rows), 1000, batch, max_bytes, cost)
    want, want_exhausted = _reference_take(rows, batch, max_bytes)
    assert [key for key, _ in got] == want and exhausted == want_exhausted
    assert next_ts == (1000 + len(want) if want else 1000)
    assert cost.keys <= len(want) + (1 if max_bytes is None else reads._CHUNK_ROWS)

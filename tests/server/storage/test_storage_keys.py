"""The key layout of a shard and the encoding of iterator states."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqds.server.storage import keys
from mqds.server.storage.iterators import IteratorDecodeError, IteratorState

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
@given(u64s, st.one_of(st.none(), st.integers(1, 2**64 - 1)), u64s, st.one_of(st.none(), u64s))
def test_generation_records_round_trip(since: int, until: int | None, created: int, last_before: int | None) -> None:
    record = keys.GenerationRecord(since_us=since, until_us=until, created_at_us=created, last_before_us=last_before)
    raw = record.encode()
    if last_before is None:  # as records were before the last message before them was kept
        assert len(raw) == 25 and raw[0] == 1
    else:
        assert len(raw) == 33 and raw[0] == keys.GENERATION_RECORD_VERSION == 2
    assert keys.GenerationRecord.decode(raw) == record


def test_a_version_1_record_reads_as_it_was_written_and_knows_nothing_stored_before_it() -> None:
    raw = bytes([1]) + keys.u64(1_000) + keys.u64(2_000) + keys.u64(999)  # the old code's encoding
    record = keys.GenerationRecord.decode(raw)
    assert record == keys.GenerationRecord(since_us=1_000, until_us=2_000, created_at_us=999)
    assert record.last_before_us is None
    assert record.encode() == raw


def test_generation_record_with_unknown_version_or_length_is_refused() -> None:
    raw = bytearray(keys.GenerationRecord(1, 2, 3, last_before_us=0).encode())
    raw[0] = 3
    with pytest.raises(ValueError, match="generation record version 3 is not supported"):
        keys.GenerationRecord.decode(bytes(raw))
    with pytest.raises(ValueError, match="version 2 is 33 bytes, not 25"):
        keys.GenerationRecord.decode(bytes([2]) + bytes(24))
    with pytest.raises(ValueError, match="version 1 is 25 bytes, not 33"):
        keys.GenerationRecord.decode(bytes([1]) + bytes(32))


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

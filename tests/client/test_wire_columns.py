"""Next answers read in C (mqds.client.core._wire_columns) against protobuf reading the same bytes.

``envelope`` and ``columns`` read a serialized ``NextResponse`` without
protobuf; hypothesis makes answers of any messages (unicode, empty fields,
repeated property names, fields the reader skips) and checks every value
against protobuf's parse, and damaged answers are refused with ValueError,
never read past their end.
"""

from __future__ import annotations

import contextlib
import itertools
import struct
import sys
from array import array
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from mqds.client import Message
from mqds.client.core import wire_columns as wc
from mqds.client.core.next_answer import next_result, parsed_next_result
from mqds.protocol.wire import varint
from mqds.v1 import storage_pb2 as pb


def test_make_install_builds_the_c_extension() -> None:
    """The fast read path is what the tests and benchmarks measure: it must be there, not the fallback."""
    assert wc.native is not None, "mqds.client.core._wire_columns is not built (make install builds it)"


_text = st.text(st.characters(codec="utf-8"), max_size=10)
_messages = st.lists(
    st.builds(
        pb.Message,
        topic=_text,
        payload=st.binary(max_size=30),
        sender=_text,
        qos=st.integers(0, 2),
        retain=st.booleans(),
        properties=st.lists(
            st.builds(pb.UserProperty, key=st.sampled_from(["a", "b", "ü", ""]) | _text, value=_text), max_size=4
        ),
        timestamp_us=st.integers(0, 2**63 - 1),
        shard=st.integers(0, 2**32 - 1),
        message_expiry_s=st.integers(0, 2**32 - 1),
    ),
    max_size=8,
)


def _answer(messages: list[pb.Message], end: bool = False, packed: bool = True) -> bytes:
    answer = pb.NextResponse(messages=messages, end_of_stream=end, streams_done=len(messages) % 3)
    answer.iterator.shard, answer.iterator.generation, answer.iterator.state = 3, 4, b"\x00pos"
    if packed:
        answer.timestamps = b"".join(struct.pack("<Q", m.timestamp_us) for m in messages)
    return answer.SerializeToString()


def _strings(offsets: bytes, data: bytes, text: bool) -> list[Any]:
    ends = array("i", offsets)
    values = [data[a:b] for a, b in itertools.pairwise(ends)]
    return [v.decode() for v in values] if text else values


def _rows(cols: wc.Columns) -> list[dict[str, Any]]:
    """The columns back as one dict a message (what a test compares)."""
    assert sys.byteorder == "little"
    n = cols.n
    keys = _strings(cols.key_offsets, cols.key_data, True)  # type: ignore[arg-type]
    values = _strings(cols.value_offsets, cols.value_data, True)  # type: ignore[arg-type]
    props = array("i", cols.property_offsets)  # type: ignore[arg-type]
    return (
        [
            {
                "topic": topic,
                "payload": payload,
                "sender": sender,
                "qos": qos,
                "retain": bool(cols.retain[i // 8] >> (i % 8) & 1),  # type: ignore[index]
                "properties": list(zip(keys[props[i] : props[i + 1]], values[props[i] : props[i + 1]], strict=True)),
                "timestamp": stamp,
            }
            for i, (topic, payload, sender, qos, stamp) in enumerate(
                zip(
                    _strings(cols.topic_offsets, cols.topic_data, True),  # type: ignore[arg-type]
                    _strings(cols.payload_offsets, cols.payload_data, False),  # type: ignore[arg-type]
                    _strings(cols.sender_offsets, cols.sender_data, True),  # type: ignore[arg-type]
                    array("i", cols.qos),  # type: ignore[arg-type]
                    array("q", cols.timestamps),  # type: ignore[arg-type]
                    strict=True,
                )
            )
        ]
        if n
        else []
    )


def _signed(value: int, bits: int) -> int:
    """An unsigned field as the column's signed integer of ``bits`` holds it (Arrow's int32 and int64)."""
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


def _expected(m: pb.Message) -> dict[str, Any]:
    return {
        "topic": m.topic,
        "payload": m.payload,
        "sender": m.sender,
        "qos": _signed(m.qos, 32),
        "retain": m.retain,
        # A name given twice keeps its first place and its last value (the Spark source's map).
        "properties": list({p.key: p.value for p in m.properties}.items()),
        "timestamp": _signed(m.timestamp_us, 64),
    }


@settings(max_examples=150, deadline=None)
@given(st.lists(_messages, max_size=4))
def test_columns_hold_every_field_of_every_message_in_order(answers: list[list[pb.Message]]) -> None:
    cols = wc.columns([_answer(messages) for messages in answers])
    assert cols.n == sum(map(len, answers))
    assert _rows(cols) == [_expected(m) for messages in answers for m in messages]


@settings(max_examples=60, deadline=None)
@given(_messages, st.sampled_from([wc.WANT_TOPIC, wc.WANT_QOS | wc.WANT_TIMESTAMP, wc.WANT_PROPERTIES, 0]))
def test_only_the_columns_asked_for_are_built(messages: list[pb.Message], want: int) -> None:
    cols = wc.columns([_answer(messages)], want)
    every = wc.columns([_answer(messages)])
    built = {
        wc.WANT_TOPIC: ("topic_offsets", "topic_data"),
        wc.WANT_QOS: ("qos",),
        wc.WANT_TIMESTAMP: ("timestamps",),
        wc.WANT_PROPERTIES: ("property_offsets", "key_offsets", "key_data", "value_offsets", "value_data"),
    }
    wanted = {name for bit, names in built.items() if want & bit for name in names}
    for name in wc.Columns._fields[1:-1]:  # not n, not skipped
        value = getattr(cols, name)
        if name in wanted and name not in ("key_data", "value_data"):
            assert value == getattr(every, name), name
        elif name not in wanted:
            assert value is None, name


@settings(max_examples=100, deadline=None)
@given(_messages, st.booleans(), st.booleans())
def test_the_envelope_is_protobufs_reading_of_it(messages: list[pb.Message], end: bool, packed: bool) -> None:
    raw = _answer(messages, end, packed)
    parsed = pb.NextResponse.FromString(raw)
    count, iterator, end_of_stream, stamps, done = wc.envelope(raw)
    assert (count, end_of_stream, stamps) == (len(parsed.messages), parsed.end_of_stream, parsed.timestamps)
    assert done == parsed.streams_done
    assert pb.IteratorToken.FromString(iterator) == parsed.iterator
    result = next_result(raw)
    assert result.messages.answer == raw and len(result.messages) == len(messages)
    assert list(result.messages) == [Message.from_pb(m) for m in parsed.messages]
    assert result.messages.answer is None, "parsed once, the batch should let its bytes go"
    assert list(result.messages.times) == [m.timestamp_us for m in messages]


def test_an_iterator_given_twice_is_merged_as_protobuf_merges_it() -> None:
    first = pb.NextResponse(iterator=pb.IteratorToken(shard=1, state=b"a")).SerializeToString()
    second = pb.NextResponse(iterator=pb.IteratorToken(generation=2, state=b"b")).SerializeToString()
    _, iterator, _, _, _ = wc.envelope(first + second)
    assert pb.IteratorToken.FromString(iterator) == pb.NextResponse.FromString(first + second).iterator


@settings(max_examples=300, deadline=None)
@given(_messages.filter(bool), st.data())
def test_a_damaged_answer_is_refused_never_read_past_its_end(messages: list[pb.Message], data: st.DataObject) -> None:
    raw = bytearray(_answer(messages))
    cut = data.draw(st.integers(0, len(raw) - 1))
    damaged = bytes(raw[:cut]) if data.draw(st.booleans()) else bytes(raw[:cut] + b"\xff" + raw[cut + 1 :])
    for read in (wc.envelope, lambda b: wc.columns([b])):
        try:
            read(damaged)
        except ValueError as err:
            assert "malformed Next answer" in str(err)


def test_wrong_input_types_are_type_errors() -> None:
    with pytest.raises(TypeError):
        wc.columns(b"x")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        wc.envelope(42)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_read_or_refused_with_value_error(data: bytes) -> None:
    """Whatever a damaged or hostile answer holds, the C reader answers or raises ValueError; it never crashes."""
    for read in (wc.envelope, lambda b: wc.columns([b, b])):
        try:
            read(data)
        except ValueError as err:
            assert "malformed Next answer" in str(err)


def test_a_field_number_past_protobufs_range_is_refused() -> None:
    """A tag whose field number does not fit 29 bits must not be read as a small one (2^32 + 1 as field 1)."""
    message = pb.Message(topic="t").SerializeToString()
    tag = ((1 << 32) + 1) << 3 | 2
    varint = bytearray()
    while tag >= 0x80:
        varint.append(tag & 0x7F | 0x80)
        tag >>= 7
    varint.append(tag)
    forged = bytes(varint) + bytes([len(message)]) + message
    for read in (wc.envelope, lambda b: wc.columns([b])):
        with pytest.raises(ValueError, match="field number"):
            read(forged)


def _field(number: int, wire: int, value: bytes) -> bytes:
    """One encoded field: its tag and ``value`` (already encoded for the wire type)."""
    return varint(number << 3 | wire) + value


_VALUES = {
    0: st.integers(0, 2**64 - 1).map(varint),
    1: st.binary(min_size=8, max_size=8),
    2: st.binary(max_size=6).map(lambda b: varint(len(b)) + b),
    5: st.binary(min_size=4, max_size=4),
}
# A field of any number a Message has or not (and 1000), of any wire type but a group: with a known number
# and another wire type, protobuf keeps it as an unknown field, and so must the reader.
_stray_fields = st.lists(
    st.tuples(st.sampled_from([*range(1, 12), 1000]), st.sampled_from(sorted(_VALUES))).flatmap(
        lambda nw: _VALUES[nw[1]].map(lambda v: _field(nw[0], nw[1], v))
    ),
    max_size=4,
)


def _with_strays(message: pb.Message, strays: list[bytes], before: bool) -> bytes:
    body = message.SerializeToString()
    extra = b"".join(strays)
    return extra + body if before else body + extra


def _answer_of(bodies: list[bytes]) -> bytes:
    return b"".join(_field(1, 2, varint(len(b)) + b) for b in bodies)


def _parseable(bodies: list[bytes]) -> list[pb.Message]:
    """The messages protobuf parses, each alone: what the rows must be."""
    parsed = []
    for body in bodies:
        with contextlib.suppress(DecodeError):
            parsed.append(pb.Message.FromString(body))
    return parsed


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_messages.filter(bool).map(lambda ms: ms[0]), _stray_fields, st.booleans()), max_size=6))
def test_fields_of_another_wire_type_or_unknown_are_skipped_as_protobuf_skips_them(
    items: list[tuple[pb.Message, list[bytes], bool]],
) -> None:
    """qos sent length-delimited, a topic sent as a varint: protobuf keeps those as unknown fields and reads
    the rest; so does the reader (it used to refuse the whole answer). A message protobuf cannot parse (a
    stray topic that is not UTF-8, a varint too long) is no row, in both."""
    bodies = [_with_strays(m, strays, before) for m, strays, before in items]
    parsed = _parseable(bodies)
    raw = _answer_of(bodies)
    cols = wc.columns([raw])
    assert (cols.n, cols.skipped) == (len(parsed), len(bodies) - len(parsed))
    assert _rows(cols) == [_expected(m) for m in parsed]
    assert wc.envelope(raw)[0] == len(items)
    assert list(parsed_next_result(raw).messages) == [Message.from_pb(m) for m in parsed]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=5))
def test_messages_of_any_bytes_are_rows_exactly_where_protobuf_parses_them(bodies: list[bytes]) -> None:
    parsed = _parseable(bodies)
    cols = wc.columns([_answer_of(bodies)])
    assert (cols.n, cols.skipped) == (len(parsed), len(bodies) - len(parsed))
    assert _rows(cols) == [_expected(m) for m in parsed]


def test_a_message_holding_an_unknown_group_is_read_as_protobuf_reads_it() -> None:
    group = _field(12, 3, _field(1, 0, b"\x05") + _field(13, 3, _field(2, 2, b"\x01x") + _field(13, 4, b""))) + (
        _field(12, 4, b"")
    )
    body = pb.Message(topic="t", qos=1).SerializeToString() + group + pb.Message(sender="s").SerializeToString()
    raw = _answer_of([body])
    (parsed,) = pb.NextResponse.FromString(raw).messages
    cols = wc.columns([raw])
    assert (cols.n, cols.skipped) == (1, 0) and _rows(cols) == [_expected(parsed)]


_good = [
    pb.Message(topic="a", payload=b"1", sender="s", qos=1, timestamp_us=10, properties=[pb.UserProperty(key="k")]),
    pb.Message(topic="b", payload=b"2", sender="s", timestamp_us=20),
]
_DAMAGED = {
    "a value past the message's end": pb.Message(topic="t").SerializeToString() + b"\x12\x09short",
    "a varint cut short": pb.Message(topic="t").SerializeToString() + b"\x20\xff",
    "a topic that is not UTF-8": _field(1, 2, b"\x02\xff\xfe"),
    "a surrogate in the sender": _field(3, 2, b"\x03\xed\xa0\x80"),
    "a user property that is not UTF-8": _field(6, 2, b"\x04" + _field(1, 2, b"\x02\xc3\x28")),
    "a user property cut short": _field(6, 2, b"\x03" + _field(2, 2, b"\x05")),
    "field number 0": b"\x00\x01",
    "wire type 7": b"\x0f",
    "a group never ended": _field(12, 3, b""),
}


@pytest.mark.parametrize("damage", sorted(_DAMAGED))
def test_a_message_that_does_not_parse_costs_its_row_not_the_answer(damage: str) -> None:
    """Both readers, the C one (columns) and protobuf's (the client's fallback): the other rows, and a count."""
    bodies = [_good[0].SerializeToString(), _DAMAGED[damage], _good[1].SerializeToString()]
    stamps = b"".join(struct.pack("<Q", t) for t in (10, 15, 20))
    raw = _answer_of(bodies) + _field(4, 2, varint(len(stamps)) + stamps)
    with pytest.raises(Exception):  # noqa: B017 - what protobuf raises varies with the damage
        pb.NextResponse.FromString(raw)
    cols = wc.columns([raw, _answer(_good)])
    assert (cols.n, cols.skipped) == (4, 1)
    assert _rows(cols) == [_expected(m) for m in _good + _good]
    assert wc.envelope(raw)[0] == 3  # the envelope reads no message: it counts the damaged one

    parsed = parsed_next_result(raw).messages  # without the C extension
    assert list(parsed) == [Message.from_pb(m) for m in _good] and parsed.skipped == 1
    assert list(parsed.times) == [10, 20]
    kept = next_result(raw).messages  # with it: the answer's bytes, parsed when a message is read
    assert len(kept) == 3 and kept.answer == raw
    assert list(kept) == [Message.from_pb(m) for m in _good] and kept.skipped == 1
    assert len(kept) == 2 and list(kept.times) == [10, 20]


def test_an_answer_whose_framing_is_damaged_is_still_refused() -> None:
    """A message's length past the answer's end: the messages cannot be told apart, so nothing is read."""
    raw = _answer(_good) + b"\x0a\x7f" + b"x" * 10
    with pytest.raises(ValueError, match="malformed Next answer"):
        wc.columns([raw])
    with pytest.raises(DecodeError):
        parsed_next_result(raw)

"""Next answers read in C (mqds.client._wire_columns) against protobuf reading the same bytes.

``envelope`` and ``columns`` read a serialized ``NextResponse`` without
protobuf; hypothesis makes answers of any messages (unicode, empty fields,
repeated property names, fields the reader skips) and checks every value
against protobuf's parse, and damaged answers are refused with ValueError,
never read past their end.
"""

from __future__ import annotations

import itertools
import struct
import sys
from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqds.client import Message
from mqds.client import wire_columns as wc
from mqds.client.next_answer import next_result
from mqds.v1 import storage_pb2 as pb


def test_make_install_builds_the_c_extension() -> None:
    """The fast read path is what the tests and benchmarks measure: it must be there, not the fallback."""
    assert wc.native is not None, "mqds.client._wire_columns is not built (make install builds it)"


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


def _expected(m: pb.Message) -> dict[str, Any]:
    return {
        "topic": m.topic,
        "payload": m.payload,
        "sender": m.sender,
        "qos": m.qos,
        "retain": m.retain,
        # A name given twice keeps its first place and its last value (the Spark source's map).
        "properties": list({p.key: p.value for p in m.properties}.items()),
        "timestamp": m.timestamp_us,
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
    for name in wc.Columns._fields[1:]:
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

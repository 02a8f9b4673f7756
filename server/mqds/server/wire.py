"""The protobuf wire form of stored messages, built from bytes without protobuf objects.

A message is stored serialised without ``timestamp_us`` and ``shard`` (see
``keys.py``). Replies append those two fields to the stored bytes (protobuf
keeps the last value of a scalar field, so appending is a valid encoding) and
wrap messages into repeated fields by hand: no message object is built per
message on the read path.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.unknown_fields import UnknownFieldSet

from mqds.protocol.wire import varint
from mqds.server.native import native_or
from mqds.v1 import storage_pb2 as pb

# -- the node's hand-encoded tags ----------------------------------------------------
#
# Every protobuf tag the node writes or reads by hand, named <message>_<field>_TAG: the field's number << 3 | its
# wire type, as bytes. Other modules import these and write no tag bytes of their own; tests/repo/test_wire_tags.py
# checks each against the generated descriptors. The client's side is mqds.protocol.wire; the C parts' tags are
# generated from the descriptors (wire_tags.h, by proto/generate.py).

# mqds.v1.Message: what a reply appends to a stored message.
MESSAGE_TIMESTAMP_US_TAG = b"\x39"  # 7, fixed64
MESSAGE_SHARD_TAG = b"\x40"  # 8, varint
MESSAGE_MESSAGE_EXPIRY_S_TAG = b"\x48"  # 9, varint: what a fetch or push appends, the remaining interval
# Answers built by hand (mqds.v1).
NEXT_RESPONSE_MESSAGES_TAG = b"\x0a"  # NextResponse.messages = 1, length-delimited
NEXT_RESPONSE_ITERATOR_TAG = b"\x12"  # NextResponse.iterator = 2, length-delimited
NEXT_RESPONSE_END_OF_STREAM_TAG = b"\x18"  # NextResponse.end_of_stream = 3, varint
NEXT_RESPONSE_TIMESTAMPS_TAG = b"\x22"  # NextResponse.timestamps = 4, length-delimited
NEXT_RESPONSE_STREAMS_DONE_TAG = b"\x28"  # NextResponse.streams_done = 5, varint
FETCH_MESSAGES_RESPONSE_MESSAGES_TAG = b"\x0a"  # FetchMessagesResponse.messages = 1, length-delimited
FETCH_MESSAGES_SHARED_RESPONSE_MESSAGES_TAG = b"\x0a"  # FetchMessagesSharedResponse.messages = 1
FOLLOW_RESPONSE_MESSAGES_TAG = b"\x1a"  # FollowResponse.messages = 3, length-delimited
STORE_STREAM_RESPONSE_SEQUENCE_TAG = b"\x08"  # StoreStreamResponse.sequence = 1, varint
STORE_STREAM_RESPONSE_RESULT_TAG = b"\x12"  # StoreStreamResponse.result = 2, length-delimited
STORE_BATCH_RESPONSE_POSITIONS_TAG = b"\x0a"  # StoreBatchResponse.positions = 1, length-delimited
MESSAGE_POSITION_SHARD_TAG = b"\x08"  # MessagePosition.shard = 1, varint
MESSAGE_POSITION_TIMESTAMP_US_TAG = b"\x10"  # MessagePosition.timestamp_us = 2, varint
# A request read by hand (mqds.v1).
STORE_STREAM_REQUEST_BATCH_TAG = b"\x0a"  # StoreStreamRequest.batch = 1, length-delimited
# The replicated store command (mqds.server.cluster.v1), built from a request's own bytes.
VNODE_COMMAND_STORE_TAG = b"\x0a"  # VnodeCommand.store = 1, length-delimited
STORE_MESSAGES_NOW_US_TAG = b"\x28"  # StoreMessages.now_us = 5, varint
# Raft (mqds.server.raft.v1): frames, append-entries and group-committed entries framed by hand.
FRAME_MESSAGES_TAG = b"\x0a"  # Frame.messages = 1, length-delimited
ENVELOPE_GROUP_TAG = b"\x08"  # Envelope.group = 1, varint
ENVELOPE_MESSAGE_TAG = b"\x12"  # Envelope.message = 2, length-delimited
RAFT_MESSAGE_APPEND_ENTRIES_TAG = b"\x1a"  # RaftMessage.append_entries = 3, length-delimited
APPEND_ENTRIES_ENTRIES_TAG = b"\x2a"  # AppendEntries.entries = 5, length-delimited
ENTRY_COMMAND_TAG = b"\x0a"  # Entry.command = 1, length-delimited
COMMAND_BATCH_COMMANDS_TAG = b"\x0a"  # CommandBatch.commands = 1, length-delimited

_pack_ts = struct.Struct("<Q").pack


def shard_field(shard: int) -> bytes:
    """The encoded ``shard`` field of mqds.v1.Message."""
    return MESSAGE_SHARD_TAG + varint(shard)


def message_wire(stored: bytes, timestamp_us: int, shard: int) -> bytes:
    """The serialised mqds.v1.Message for a stored one: fields appended, last wins."""
    return stored + MESSAGE_TIMESTAMP_US_TAG + _pack_ts(timestamp_us) + shard_field(shard)


def decode_message(stored: bytes, timestamp_us: int, shard: int) -> pb.Message:
    """A stored message as an mqds.v1.Message with its timestamp and shard."""
    return pb.Message.FromString(message_wire(stored, timestamp_us, shard))


def encode_messages(tag: bytes, entries: list[tuple[int, bytes]], shard: int) -> bytes:
    """Stored entries as a repeated mqds.v1.Message field with number ``tag``, ready to send."""
    tail = shard_field(shard)
    parts = []
    for ts, stored in entries:
        item = stored + MESSAGE_TIMESTAMP_US_TAG + _pack_ts(ts) + tail
        parts.append(tag + varint(len(item)) + item)
    return b"".join(parts)


def message_expiry_python(stored: bytes) -> int:
    """:func:`message_expiry_s` by protobuf: the reference the C scan (``_wire_native``) is tested against."""
    return int(pb.Message.FromString(stored).message_expiry_s)


message_expiry_s: Callable[[bytes], int] = native_or(
    "mqds.server._wire_native", "message_expiry", message_expiry_python
)
"""The Message Expiry Interval a stored message holds, in seconds (0: none), as protobuf reads it.

In C a scan of the tags that skips every value by its length (tens of
nanoseconds, whatever the payload); by protobuf otherwise. Offline fetches
and push subscriptions call it once per message they hand out
(``storage/expiry.py``, ``message_left``).
"""


def expiry_intervals_python(values: list[bytes]) -> list[tuple[int, int]]:
    """:func:`expiry_intervals` by protobuf: the reference the C scan (``_wire_native``) is tested against."""
    return [(i, expiry) for i, value in enumerate(values) if (expiry := message_expiry_python(value))]


expiry_intervals: Callable[[list[bytes]], list[tuple[int, int]]] = native_or(
    "mqds.server._wire_native", "expiry_intervals", expiry_intervals_python
)
"""The stored messages of a list (a stored batch's values) that hold a Message Expiry Interval: (index, interval).

One C call for the batch (a few nanoseconds a message, most of which have
none); the store path indexes them for removal (``storage/expiry.py``).
"""


def with_expiry(stored: bytes, remaining_s: int) -> bytes:
    """A stored message with its ``message_expiry_s`` set to ``remaining_s``: the field appended, last wins."""
    return stored + MESSAGE_MESSAGE_EXPIRY_S_TAG + varint(remaining_s)


_HEADS: dict[tuple[bytes, int], list[bytes]] = {}
_HEAD_SIZES = 4096


def encode_rows_python(tag: bytes, rows: list[tuple[bytes, bytes]], tail: bytes) -> tuple[bytes, bytes]:
    """:func:`encode_rows` in Python: the reference the C version (``_wire_native``) is tested against."""
    extra = 1 + 8 + len(tail)
    heads = _HEADS.get((tag, extra))
    if heads is None:
        heads = _HEADS.setdefault((tag, extra), [tag + varint(size + extra) for size in range(_HEAD_SIZES)])
    parts: list[bytes] = []
    add = parts.extend
    times: list[bytes] = []
    stamp = times.append
    for key, stored in rows:
        size = len(stored)
        head = heads[size] if size < _HEAD_SIZES else tag + varint(size + extra)
        # key[12:4:-1]: the key's timestamp bytes (5..12), reversed.
        ts = key[12:4:-1]
        add((head, stored, MESSAGE_TIMESTAMP_US_TAG, ts, tail))
        stamp(ts)
    return b"".join(parts), b"".join(times)


_ENCODE_ROWS = native_or("mqds.server._wire_native", "encode_rows", encode_rows_python)
NATIVE = _ENCODE_ROWS is not encode_rows_python
"""Whether the read path encodes in C; a node that does not logs a warning when it starts."""


def encode_rows(tag: bytes, rows: list[tuple[bytes, bytes]], shard: int) -> tuple[bytes, bytes]:
    """Stored rows (data key, stored bytes) as a repeated mqds.v1.Message field with number ``tag``.

    The same bytes as ``encode_messages``, built without decoding a timestamp:
    a data key ends with it big-endian, and fixed64 is the same eight bytes
    reversed. Also each message's timestamp, 8 bytes little-endian as fixed64
    has it, joined (``NextResponse.timestamps``' content).

    This is the replay's encoding: in C (``_wire_native.c``, built with the
    package where a compiler is present), about 0.03 µs a message where the
    Python loop takes 0.3-0.5; the Python one otherwise, or with the
    environment variable ``MQDS_PURE_PYTHON`` set.
    """
    return _ENCODE_ROWS(tag, rows, shard_field(shard))


def times_field(tag: bytes, stamps: bytes) -> bytes:
    """Timestamps that :func:`encode_rows` returned (8 bytes little-endian each) as one field ``tag``.

    ``NextResponse.timestamps``; nothing when there are none.
    """
    if not stamps:
        return b""
    return tag + varint(len(stamps)) + stamps


def repeated_field(tag: bytes, items: list[bytes]) -> bytes:
    """Encode ``items`` as a repeated length-delimited protobuf field."""
    return b"".join(tag + varint(len(item)) + item for item in items)


# -- the store command and its answer ---------------------------------------------


def store_command(request: bytes, now_us: int) -> bytes:
    """The VnodeCommand storing a StoreBatchRequest's messages at ``now_us``, from the request's own bytes.

    StoreMessages is wire-compatible with StoreBatchRequest (see commands.proto): the request's
    bytes plus ``now_us`` are the command, without decoding a message.
    """
    inner = request + STORE_MESSAGES_NOW_US_TAG + varint(now_us)
    return VNODE_COMMAND_STORE_TAG + varint(len(inner)) + inner


def positions_bytes(shard: int, first: int, count: int) -> bytes:
    """An encoded StoreBatchResponse for ``count`` messages stored in ``shard`` from timestamp ``first`` on.

    Built without a protobuf object per message: consecutive timestamps share
    every varint byte but the first within each run of 128.
    """
    head = (MESSAGE_POSITION_SHARD_TAG + varint(shard) if shard else b"") + MESSAGE_POSITION_TIMESTAMP_US_TAG
    out: list[bytes] = []
    tag = STORE_BATCH_RESPONSE_POSITIONS_TAG
    ts, end = first, first + count
    while ts < end:
        high = ts >> 7
        stop = min(end, (high + 1) << 7)
        if high == 0:
            out.extend(tag + varint(len(head) + len(varint(t))) + head + varint(t) for t in range(ts, stop))
        else:
            tail = varint(high)
            lead = tag + varint(len(head) + 1 + len(tail)) + head
            out.extend(lead + _LOW7[t & 0x7F] + tail for t in range(ts, stop))
        ts = stop
    return b"".join(out)


_LOW7 = [bytes((0x80 | low,)) for low in range(128)]


# -- fields a stored message must not hold -------------------------------------------

# A field of one of these types comes as this wire type (protobuf's encoding).
_WIRE_OF_TYPE = {
    **dict.fromkeys((FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE), 2),
    **dict.fromkeys((FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64, FieldDescriptor.TYPE_DOUBLE), 1),
    **dict.fromkeys((FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_SFIXED32, FieldDescriptor.TYPE_FLOAT), 5),
}
_WIRE_NAMES = {0: "varint", 1: "64-bit", 2: "length-delimited", 3: "group start", 4: "group end", 5: "32-bit"}
_NO_FIELD = 0xFF


def _wire_table(descriptor: Any) -> bytes:
    """Per field number of ``descriptor``'s message, the wire type the field comes as (0xFF: no such field)."""
    table = bytearray([_NO_FIELD]) * (max(f.number for f in descriptor.fields) + 1)
    for f in descriptor.fields:
        # A packed repeated scalar may come as either wire type: the scan knows only one a field.
        assert f.type in (f.TYPE_STRING, f.TYPE_BYTES, f.TYPE_MESSAGE) or not f.is_repeated, f.full_name
        table[f.number] = _WIRE_OF_TYPE.get(f.type, 0)
    return bytes(table)


_MESSAGE_TYPES = _wire_table(pb.Message.DESCRIPTOR)
_PROPERTY_FIELD = pb.Message.DESCRIPTOR.fields_by_name["properties"].number
_PROPERTY_TYPES = _wire_table(pb.UserProperty.DESCRIPTOR)

UnknownField = tuple[int, int, int, int]
"""A message holding a field it does not have as it came: (its index in the request, the user property holding
the field, 1-based, or 0 for the message's own field, the field's number, the wire type it came as)."""


def message_unknown_field(index: int, message: pb.Message) -> UnknownField | None:
    """``message``'s first unknown field (see :data:`UnknownField`), or None: protobuf's reading of the same."""
    own = UnknownFieldSet(message)
    if len(own):
        return index, 0, own[0].field_number, own[0].wire_type
    for number, prop in enumerate(message.properties, 1):
        theirs = UnknownFieldSet(prop)
        if len(theirs):
            return index, number, theirs[0].field_number, theirs[0].wire_type
    return None


def unknown_fields_python(request: bytes) -> list[UnknownField]:
    """:func:`unknown_fields` by protobuf: the reference the C scan (``_wire_native``) is tested against."""
    messages = pb.StoreBatchRequest.FromString(request).messages
    return [found for index, m in enumerate(messages) if (found := message_unknown_field(index, m)) is not None]


_UNKNOWN_FIELDS_C: Callable[[bytes, bytes, int, bytes], list[UnknownField] | None] | None = native_or(
    "mqds.server._wire_native", "unknown_fields", None
)


def unknown_fields(request: bytes) -> list[UnknownField]:
    """The messages of a serialized StoreBatchRequest that hold a field mqds.v1.Message (or a UserProperty of it)
    does not have, or one that came as another wire type; [] for a request without any (the common case).

    protobuf keeps such a field as an unknown field, and a stored message
    keeps its bytes as they came: a field of the wrong type would then reach
    readers that read the bytes themselves (the client's column reader), so
    the store refuses the message. In C (``_wire_native.c``) a scan of the
    tags, skipping every value by its length: about 10 ns a message; by
    protobuf's unknown fields otherwise (about 0.6 µs a message).
    """
    if _UNKNOWN_FIELDS_C is not None:
        found = _UNKNOWN_FIELDS_C(request, _MESSAGE_TYPES, _PROPERTY_FIELD, _PROPERTY_TYPES)
        if found is not None:
            return found
    return unknown_fields_python(request)


def unknown_field_text(found: UnknownField) -> str:
    """What is wrong with a message :func:`unknown_fields` found, in words."""
    _, prop, number, wire = found
    descriptor = pb.UserProperty.DESCRIPTOR if prop else pb.Message.DESCRIPTOR
    where = f"user property {prop}: " if prop else ""
    field = descriptor.fields_by_number.get(number)
    came = f"wire type {wire} ({_WIRE_NAMES.get(wire, 'invalid')})"
    if field is None:
        return (
            f"{where}field {number} ({came}) is not a field of {descriptor.full_name}; a message is stored with "
            "its declared fields only"
        )
    expected = _WIRE_OF_TYPE.get(field.type, 0)
    return f"{where}field {number} ({field.name}) came as {came}, not as {_WIRE_NAMES[expected]} as its type needs"

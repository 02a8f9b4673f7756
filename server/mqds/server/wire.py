"""The protobuf wire form of stored messages, built from bytes without protobuf objects.

A message is stored serialised without ``timestamp_us`` and ``shard`` (see
``keys.py``). Replies append those two fields to the stored bytes (protobuf
keeps the last value of a scalar field, so appending is a valid encoding) and
wrap messages into repeated fields by hand: no message object is built per
message on the read path.
"""

from __future__ import annotations

import struct

from mqds.v1 import storage_pb2 as pb


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# Varint encodings of small lengths, looked up instead of computed per message.
_SMALL_VARINTS = [_varint(n) for n in range(1 << 14)]


def varint(value: int) -> bytes:
    """The protobuf varint encoding of a non-negative integer."""
    return _SMALL_VARINTS[value] if value < 16384 else _varint(value)


_TS_TAG = b"\x39"  # field 7 (timestamp_us), fixed64
_SHARD_TAG = b"\x40"  # field 8 (shard), varint
_pack_ts = struct.Struct("<Q").pack


def shard_field(shard: int) -> bytes:
    """The encoded ``shard`` field of mqds.v1.Message."""
    return _SHARD_TAG + varint(shard)


def message_wire(stored: bytes, timestamp_us: int, shard: int) -> bytes:
    """The serialised mqds.v1.Message for a stored one: fields appended, last wins."""
    return stored + _TS_TAG + _pack_ts(timestamp_us) + shard_field(shard)


def decode_message(stored: bytes, timestamp_us: int, shard: int) -> pb.Message:
    """A stored message as an mqds.v1.Message with its timestamp and shard."""
    return pb.Message.FromString(message_wire(stored, timestamp_us, shard))


def encode_messages(tag: bytes, entries: list[tuple[int, bytes]], shard: int) -> bytes:
    """Stored entries as a repeated mqds.v1.Message field with number ``tag``, ready to send."""
    tail = shard_field(shard)
    parts = []
    for ts, stored in entries:
        item = stored + _TS_TAG + _pack_ts(ts) + tail
        parts.append(tag + varint(len(item)) + item)
    return b"".join(parts)


def repeated_field(tag: bytes, items: list[bytes]) -> bytes:
    """Encode ``items`` as a repeated length-delimited protobuf field."""
    return b"".join(tag + varint(len(item)) + item for item in items)

"""The protobuf wire form of stored messages, built from bytes without protobuf objects.

A message is stored serialised without ``timestamp_us`` and ``shard`` (see
``keys.py``). Replies append those two fields to the stored bytes (protobuf
keeps the last value of a scalar field, so appending is a valid encoding) and
wrap messages into repeated fields by hand: no message object is built per
message on the read path.
"""

from __future__ import annotations

import struct

from mqds.protocol.wire import varint
from mqds.server.native import native_or
from mqds.v1 import storage_pb2 as pb

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
        add((head, stored, _TS_TAG, ts, tail))
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

STORE_TAG = b"\x0a"  # VnodeCommand.store, field 1, length-delimited
NOW_US_TAG = b"\x28"  # StoreMessages.now_us, field 5, varint
_POSITION_TAG = b"\x0a"  # StoreBatchResponse.positions, field 1, length-delimited


def store_command(request: bytes, now_us: int) -> bytes:
    """The VnodeCommand storing a StoreBatchRequest's messages at ``now_us``, from the request's own bytes.

    StoreMessages is wire-compatible with StoreBatchRequest (see commands.proto): the request's
    bytes plus ``now_us`` are the command, without decoding a message.
    """
    inner = request + NOW_US_TAG + varint(now_us)
    return STORE_TAG + varint(len(inner)) + inner


def positions_bytes(shard: int, first: int, count: int) -> bytes:
    """An encoded StoreBatchResponse for ``count`` messages stored in ``shard`` from timestamp ``first`` on.

    Built without a protobuf object per message: consecutive timestamps share
    every varint byte but the first within each run of 128.
    """
    head = (b"\x08" + varint(shard) if shard else b"") + b"\x10"
    out: list[bytes] = []
    ts, end = first, first + count
    while ts < end:
        high = ts >> 7
        stop = min(end, (high + 1) << 7)
        if high == 0:
            out.extend(_POSITION_TAG + varint(len(head) + len(varint(t))) + head + varint(t) for t in range(ts, stop))
        else:
            tail = varint(high)
            lead = _POSITION_TAG + varint(len(head) + 1 + len(tail)) + head
            out.extend(lead + _LOW7[t & 0x7F] + tail for t in range(ts, stop))
        ts = stop
    return b"".join(out)


_LOW7 = [bytes((0x80 | low,)) for low in range(128)]

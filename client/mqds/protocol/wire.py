"""Protobuf wire encoding by hand, for what is built once per message on a hot path.

A pipelined one-message write used to build a ``mqds.v1.Message`` object,
copy it into a ``StoreBatchRequest`` and serialise that: three passes over
every message. Encoding the message's fields straight to bytes once, when the
call is queued, and joining those bytes into a batch's frame costs a third of
that (``tests/unit/test_wire_encoding.py`` checks the bytes against
protobuf's own parser). The node's side of the same form is
:mod:`mqds.server.wire`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# Varint encodings of small values (lengths, qos), looked up instead of computed.
_SMALL_VARINTS = [_varint(n) for n in range(1 << 14)]


def varint(value: int) -> bytes:
    """The protobuf varint encoding of a non-negative integer."""
    return _SMALL_VARINTS[value] if value < 16384 else _varint(value)


def length_delimited(tag: bytes, body: bytes) -> bytes:
    """A length-delimited field: its tag byte(s), the body's length, the body."""
    return tag + varint(len(body)) + body


# mqds.v1.Message's fields (field number << 3 | wire type).
_TOPIC = b"\x0a"  # 1, string
_PAYLOAD = b"\x12"  # 2, bytes
_SENDER = b"\x1a"  # 3, string
_QOS = b"\x20"  # 4, uint32
_RETAIN_TRUE = b"\x28\x01"  # 5, bool
_PROPERTY = b"\x32"  # 6, repeated UserProperty {key = 1; value = 2}
_MESSAGES = b"\x0a"  # StoreBatchRequest.messages = 1
_SYNC_TRUE = b"\x10\x01"  # StoreBatchRequest.sync = 2
_PRODUCER = b"\x1a"  # StoreBatchRequest.producer_id = 3
_SEQUENCE = b"\x20"  # StoreBatchRequest.sequence = 4, uint64
_BATCH = b"\x0a"  # StoreStreamRequest.batch = 1


def encode_message(
    topic: str,
    payload: bytes,
    sender: str,
    qos: int,
    retain: bool,
    properties: Sequence[tuple[str, str]] = (),
) -> bytes:
    """The wire form of a ``mqds.v1.Message`` to store (no ``timestamp_us`` or ``shard``).

    The same bytes as ``Message(...).SerializeToString()``: fields in number
    order, defaults (an empty string, qos 0, retain false) left out.
    """
    t = topic.encode("utf-8")
    parts = [_TOPIC, varint(len(t)), t] if t else []
    if payload:
        parts += (_PAYLOAD, varint(len(payload)), payload)
    if sender:
        s = sender.encode("utf-8")
        parts += (_SENDER, varint(len(s)), s)
    if qos:
        parts += (_QOS, varint(qos))
    if retain:
        parts.append(_RETAIN_TRUE)
    for key, value in properties:
        entry = b""
        if key:
            entry += length_delimited(b"\x0a", key.encode("utf-8"))
        if value:
            entry += length_delimited(b"\x12", value.encode("utf-8"))
        parts += (_PROPERTY, varint(len(entry)), entry)
    return b"".join(parts)


def store_stream_frame(messages: Iterable[bytes], producer_id: str, sequence: int) -> bytes:
    """A ``StoreStreamRequest`` carrying ``StoreBatchRequest(messages, sync=True, producer_id, sequence)``.

    ``messages`` are wire forms from :func:`encode_message`.
    """
    v = _SMALL_VARINTS
    parts: list[bytes] = []
    for m in messages:
        size = len(m)
        parts += (_MESSAGES, v[size] if size < 16384 else _varint(size), m)
    parts.append(_SYNC_TRUE)
    if producer_id:
        parts.append(length_delimited(_PRODUCER, producer_id.encode("utf-8")))
    if sequence:
        parts += (_SEQUENCE, varint(sequence))
    return length_delimited(_BATCH, b"".join(parts))

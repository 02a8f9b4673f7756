"""Protobuf wire encoding by hand, for what is built once per message on a hot path.

A pipelined one-message write used to build a ``mqds.v1.Message`` object,
copy it into a ``StoreBatchRequest`` and serialise that: three passes over
every message. Encoding the message's fields straight to bytes once, when the
call is queued, and joining those bytes into a batch's frame costs a third of
that (``tests/protocol/test_wire_encoding.py`` checks the bytes against
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


# -- the client's hand-encoded tags ----------------------------------------------
#
# Every protobuf tag the client writes or reads by hand, named <message>_<field>_TAG: the field's number << 3 | its
# wire type, as bytes. Other modules import these and write no tag bytes of their own; tests/repo/test_wire_tags.py
# checks each against the generated descriptors. The node's side is mqds.server.wire; the C parts' tags are
# generated from the descriptors (wire_tags.h, by proto/generate.py).

# mqds.v1.Message, to store (no timestamp_us or shard).
MESSAGE_TOPIC_TAG = b"\x0a"  # 1, string
MESSAGE_PAYLOAD_TAG = b"\x12"  # 2, bytes
MESSAGE_SENDER_TAG = b"\x1a"  # 3, string
MESSAGE_QOS_TAG = b"\x20"  # 4, uint32 (varint)
MESSAGE_RETAIN_TAG = b"\x28"  # 5, bool (varint)
MESSAGE_PROPERTIES_TAG = b"\x32"  # 6, repeated UserProperty
MESSAGE_MESSAGE_EXPIRY_S_TAG = b"\x48"  # 9, uint32 (varint)
USER_PROPERTY_KEY_TAG = b"\x0a"  # UserProperty.key = 1, string
USER_PROPERTY_VALUE_TAG = b"\x12"  # UserProperty.value = 2, string
# The pipelined write's frame.
STORE_BATCH_REQUEST_MESSAGES_TAG = b"\x0a"  # StoreBatchRequest.messages = 1, repeated Message
STORE_BATCH_REQUEST_SYNC_TAG = b"\x10"  # StoreBatchRequest.sync = 2, bool (varint)
STORE_BATCH_REQUEST_PRODUCER_ID_TAG = b"\x1a"  # StoreBatchRequest.producer_id = 3, string
STORE_BATCH_REQUEST_SEQUENCE_TAG = b"\x20"  # StoreBatchRequest.sequence = 4, uint64 (varint)
STORE_STREAM_REQUEST_BATCH_TAG = b"\x0a"  # StoreStreamRequest.batch = 1, StoreBatchRequest
# A Next answer read field by field (mqds.client.core.answer_rows).
NEXT_RESPONSE_MESSAGES_TAG = b"\x0a"  # NextResponse.messages = 1, repeated Message

_TRUE = varint(1)
_RETAIN_TRUE = MESSAGE_RETAIN_TAG + _TRUE
_SYNC_TRUE = STORE_BATCH_REQUEST_SYNC_TAG + _TRUE


def encode_message(
    topic: str,
    payload: bytes,
    sender: str,
    qos: int,
    retain: bool,
    properties: Sequence[tuple[str, str]] = (),
    message_expiry_s: int = 0,
) -> bytes:
    """The wire form of a ``mqds.v1.Message`` to store (no ``timestamp_us`` or ``shard``).

    The same bytes as ``Message(...).SerializeToString()``: fields in number
    order, defaults (an empty string, qos 0, retain false) left out.
    """
    t = topic.encode("utf-8")
    parts = [MESSAGE_TOPIC_TAG, varint(len(t)), t] if t else []
    if payload:
        parts += (MESSAGE_PAYLOAD_TAG, varint(len(payload)), payload)
    if sender:
        s = sender.encode("utf-8")
        parts += (MESSAGE_SENDER_TAG, varint(len(s)), s)
    if qos:
        parts += (MESSAGE_QOS_TAG, varint(qos))
    if retain:
        parts.append(_RETAIN_TRUE)
    for key, value in properties:
        entry = b""
        if key:
            entry += length_delimited(USER_PROPERTY_KEY_TAG, key.encode("utf-8"))
        if value:
            entry += length_delimited(USER_PROPERTY_VALUE_TAG, value.encode("utf-8"))
        parts += (MESSAGE_PROPERTIES_TAG, varint(len(entry)), entry)
    if message_expiry_s:
        parts += (MESSAGE_MESSAGE_EXPIRY_S_TAG, varint(message_expiry_s))
    return b"".join(parts)


def store_stream_frame(messages: Iterable[bytes], producer_id: str, sequence: int) -> bytes:
    """A ``StoreStreamRequest`` carrying ``StoreBatchRequest(messages, sync=True, producer_id, sequence)``.

    ``messages`` are wire forms from :func:`encode_message`.
    """
    v = _SMALL_VARINTS
    parts: list[bytes] = []
    for m in messages:
        size = len(m)
        parts += (STORE_BATCH_REQUEST_MESSAGES_TAG, v[size] if size < 16384 else _varint(size), m)
    parts.append(_SYNC_TRUE)
    if producer_id:
        parts.append(length_delimited(STORE_BATCH_REQUEST_PRODUCER_ID_TAG, producer_id.encode("utf-8")))
    if sequence:
        parts += (STORE_BATCH_REQUEST_SEQUENCE_TAG, varint(sequence))
    return length_delimited(STORE_STREAM_REQUEST_BATCH_TAG, b"".join(parts))

"""A ``Next`` answer parsed by protobuf, a damaged message left out rather than the whole answer refused.

protobuf parses an answer in one step, and one message it cannot parse (a
value running past the message's end, a string that is not UTF-8) fails the
whole answer: every other message of the range would be unreadable. A node
stores only messages that parsed, so only damage makes one (a bug, a disk
fault the checksums missed); the reader must survive it without losing the
rest. :func:`parse_answer` parses as before and, only
when that fails, again message by message, leaving out (and counting) those
that do not parse; what is around the messages (the iterator, the flags)
must parse, or the answer is refused as before.

The C column reader (:mod:`mqds.client.core.wire_columns`) does the same for the
Spark source: a message that does not parse is no row, and is counted.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from mqds.protocol.wire import NEXT_RESPONSE_MESSAGES_TAG
from mqds.v1 import storage_pb2 as pb

(_MESSAGES_TAG,) = NEXT_RESPONSE_MESSAGES_TAG  # NextResponse.messages, as the varint it is read as
_TIMESTAMP_SIZE = 8  # NextResponse.timestamps: 8 bytes a message


def parse_answer(raw: bytes) -> tuple[pb.NextResponse, list[int]]:
    """``raw`` (a serialized ``NextResponse``) parsed, and the indexes of the messages left out because they do
    not parse ([] for a sound answer: one protobuf parse). The packed timestamps of those are left out too.

    Raises ``DecodeError`` when the answer's own framing is damaged (the
    messages cannot be told apart) or what is around them does not parse.
    """
    try:
        return pb.NextResponse.FromString(raw), []
    except DecodeError:
        pass
    response = pb.NextResponse()
    skipped: list[int] = []
    rest: list[bytes] = []
    index = 0
    for number, wire, start, body, end in _fields(raw):
        if (number << 3 | wire) == _MESSAGES_TAG:
            try:
                response.messages.append(pb.Message.FromString(raw[body:end]))
            except DecodeError:
                skipped.append(index)
            index += 1
        else:
            rest.append(raw[start:end])
    response.MergeFromString(b"".join(rest))
    stamps = response.timestamps
    if skipped and len(stamps) == _TIMESTAMP_SIZE * index:
        gone = set(skipped)
        response.timestamps = b"".join(
            stamps[i * _TIMESTAMP_SIZE : (i + 1) * _TIMESTAMP_SIZE] for i in range(index) if i not in gone
        )
    return response, skipped


def _fields(raw: bytes) -> list[tuple[int, int, int, int, int]]:
    """The top-level fields of a message's bytes: (number, wire type, start, start of the value, end)."""
    out = []
    pos, size = 0, len(raw)
    while pos < size:
        start = pos
        tag, pos = _varint(raw, pos)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise DecodeError("field number 0")
        body = pos
        if wire == 0:
            _, pos = _varint(raw, pos)
        elif wire == 1:
            pos += 8
        elif wire == 2:
            length, body = _varint(raw, pos)
            pos = body + length
        elif wire == 5:
            pos += 4
        else:  # a group around the messages: never in an answer of a node
            raise DecodeError(f"wire type {wire} between the messages")
        if pos > size:
            raise DecodeError("a field runs past the end of the answer")
        out.append((number, wire, start, body, pos))
    return out


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(raw) and shift < 64:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise DecodeError("a varint runs past the end of the answer")

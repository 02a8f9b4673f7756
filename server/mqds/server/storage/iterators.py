"""The storage layer's iterator state and its byte encoding.

An iterator is a position in a stream: the shard, generation and stream, the
topic filter, and the next timestamp to read. Because a stream's keys order by
timestamp and timestamps are stable (every replica assigns the same ones), the
position survives restarts of any node and can be resumed on any replica.

Encoding (version 1): ``b"MQI"``, u8 version, u32 shard, u32 generation,
u32 stream, u64 next timestamp, the UTF-8 filter, then a CRC-32 of everything
before it, so garbage and truncated tokens are rejected instead of misread.

>>> state = IteratorState(shard=3, generation=2, stream=11, topic_filter="s/+/t", next_ts=100)
>>> IteratorState.decode(state.encode()) == state
True
>>> IteratorState.decode(b"garbage")
Traceback (most recent call last):
...
mqds.server.storage.iterators.IteratorDecodeError: iterator is 7 bytes, too short to be an mqds iterator
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, replace

MAGIC = b"MQI"
VERSION = 1
_HEADER = struct.Struct(">3sBIIIQ")
_CRC = struct.Struct(">I")


class IteratorDecodeError(ValueError):
    """The bytes are not an iterator this version of mqds wrote."""


@dataclass(frozen=True)
class IteratorState:
    shard: int
    generation: int
    stream: int
    topic_filter: str
    next_ts: int

    def advanced(self, next_ts: int) -> IteratorState:
        return replace(self, next_ts=next_ts)

    def encode(self) -> bytes:
        body = _HEADER.pack(MAGIC, VERSION, self.shard, self.generation, self.stream, self.next_ts)
        body += self.topic_filter.encode("utf-8")
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def decode(cls, raw: bytes) -> IteratorState:
        if len(raw) < _HEADER.size + _CRC.size:
            raise IteratorDecodeError(f"iterator is {len(raw)} bytes, too short to be an mqds iterator")
        body, crc = raw[: -_CRC.size], _CRC.unpack(raw[-_CRC.size :])[0]
        magic, version, shard, generation, stream, next_ts = _HEADER.unpack_from(body)
        if magic != MAGIC:
            raise IteratorDecodeError("not an mqds iterator (bad magic bytes)")
        if version != VERSION:
            raise IteratorDecodeError(f"iterator format version {version} is not supported (this node reads 1)")
        if zlib.crc32(body) != crc:
            raise IteratorDecodeError("iterator is corrupt (checksum mismatch)")
        try:
            topic_filter = body[_HEADER.size :].decode("utf-8")
        except UnicodeDecodeError:
            raise IteratorDecodeError("iterator is corrupt (filter is not UTF-8)") from None
        return cls(shard, generation, stream, topic_filter, next_ts)

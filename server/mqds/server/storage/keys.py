"""The RocksDB key layout of a shard: the one place it is defined.

Each shard (vnode) is one RocksDB database. Its ``default`` column family holds
the shard's metadata; each generation is a column family of its own, named
``gen-<8 digit number>``, so dropping a generation drops the column family and
frees its files without per-key deletes. All integers are big-endian so byte
order is numeric order.

=====================  ==========================================  =========================================
column family          key                                         value
=====================  ==========================================  =========================================
default                ``m:format``                                u16 layout version of the database (2)
default                ``m:shard``                                 u32 shard number
default                ``m:last_ts``                               u64 last timestamp assigned (microseconds)
default                ``m:applied``                               u64 last applied Raft index
default                ``m:lts``                                   u32 thresholds: top level, other levels
default                ``m:next_node``                             u32 next free trie node id
default                ``m:restoring``                             empty or u64: a restore began and has not
                                                                   finished or been abandoned (``restore.py``);
                                                                   other commands are refused. The u64: the
                                                                   largest timestamp of the records written
default                ``g:`` u32 generation                       generation record (see ``GenerationRecord``)
default                ``v:`` u32 generation                       u64 changes: delete or retention steps that
                                                                   removed keys of the generation (a backup's
                                                                   incremental copy compares it)
default                ``t:`` u32 parent node, token (UTF-8)       u32 child node id
default                ``p:`` u32 generation, u32 stream           empty: the stream has data in the generation
default                ``d:`` u16 len, producer id, u64 sequence   ``DedupRecord``: a batch already stored
default                ``e:`` u64 stored at, ``d:`` key suffix     empty: the time index that expires ``d:`` keys
default                ``m:dedup_pruned``                          u64 last pruning round (stored-at / prune period)
default                ``c:`` clientid                             ``mqds.v1.ClientState`` (clientid left out)
default                ``n:`` u16 len, node, clientid              empty: the client is online on the node
default                ``s:`` u16 len, clientid, topic filter      u8 qos: a proxy subscription
default                ``a:`` u16 len, clientid, topic filter      ``mqds.v1.ReadPosition``: acked per shard
default                ``r:`` topic                                retained ``mqds.v1.Message`` (with its time)
default                ``x:`` u64 expires at, topic                 empty: the retained message of the topic
                                                                   expires then (``message_expiry_s``)
default                ``y:`` u64 expires at, clientid              empty: the offline client's session expires
                                                                   then (``session_expiry_s``)
default                ``z:`` u32 generation, u64 expires at,      empty: the stored message expires then
                       u32 stream, u64 timestamp                   (``message_expiry_s``; ``expiry.py``)
default                ``q:`` u64 timestamp                        empty: a queue reader acknowledged the
                                                                   message stored at this timestamp
default                ``f:`` topic filter                         u64 queue floor: every message up to this
                                                                   timestamp matching the filter is acknowledged
default                ``h:`` u16 len, group, u16 len, filter,     u64 lease end: a member of a share group
                       member                                      (``share_groups.py``)
default                ``w:`` u16 len, clientid, u16 len, filter,  a delivery waiting for its acknowledgement
                       u64 timestamp                               (``deliveries.py``): u32 deliveries, u64
                                                                   due at (redelivery), the message's topic
default                ``o:`` u16 len, clientid, u16 len, filter   u64 delivered cursor: the consumer was
                                                                   offered every message up to it
gen-NNNNNNNN           ``D`` u32 stream, u64 timestamp             message: a serialised ``mqds.v1.Message``
                                                                   without ``timestamp_us`` and ``shard``
gen-NNNNNNNN           ``I`` u32 stream, u8 level, 8-byte hash,    postings: which messages of one stored batch
                       u64 timestamp of the first such message     have this value at the stream's varying level
                                                                   (see ``encode_postings``)
=====================  ==========================================  =========================================

Only the first ``MAX_INDEXED_LEVELS`` varying levels of a topic get index keys
(the level number is one byte, and each index key costs a write); a filter that
constrains only deeper varying levels scans the stream and checks each topic.

An index key covers one stored batch: all of its messages that have the value
at that level, as a posting list, so a batch of 1,000 messages from a few
devices writes a few index keys instead of 1,000 (the memtable inserts of index
keys were half the cost of applying a batch). The value is empty when the
batch had one such message, at the key's timestamp; databases written before
posting lists have only such keys and read the same.

A trie token is a literal topic level, ``+`` for the wildcard edge, or ``#``
for the end of a topic; none of them can be a literal level, because topic
names contain neither ``+`` nor ``#``. A stream's id is the id of the trie node
its ``#`` edge leads to. The hash of a varying level is the first 8 bytes of
BLAKE2b of its UTF-8 text; collisions only cost extra reads, because readers
check the topic of each candidate message.

Examples (these run as tests):

>>> data_key(7, 1_700_000_000_000_000).hex()
'440000000700060a24181e4000'
>>> parse_data_key(data_key(7, 42))
(7, 42)
>>> index_prefix(7, 0, "42").hex()
'49000000070057b43cf02666687a'
>>> index_key(index_prefix(7, 0, "42"), 5)[-8:] == (5).to_bytes(8, "big")
True
>>> decode_postings(1_000, encode_postings([3, 4, 9]))
[1000, 1001, 1006]
>>> decode_postings(1_000, encode_postings([3]))
[1000]
>>> trie_edge_key(0, "sensor")
b't:\\x00\\x00\\x00\\x00sensor'
>>> generation_cf(3)
'gen-00000003'
>>> GenerationRecord.decode(GenerationRecord(since_us=10, until_us=None, created_at_us=9, last_before_us=7).encode())
GenerationRecord(since_us=10, until_us=None, created_at_us=9, last_before_us=7)
>>> GenerationRecord(since_us=10, until_us=20, created_at_us=9).encode()[0]  # without last_before_us: version 1
1
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from dataclasses import dataclass

FORMAT_VERSION = 2
"""2: index keys hold posting lists (1: one index key per message, empty values)."""
READABLE_FORMATS = (1, 2)
GENERATION_RECORD_VERSION = 2
"""2: generation records keep the last timestamp stored before them (1, still read: without it)."""

META_FORMAT = b"m:format"
META_SHARD = b"m:shard"
META_LAST_TS = b"m:last_ts"
META_APPLIED = b"m:applied"
# The last part written of a log entry that is applied in several writes (a
# group-committed entry, see ShardStorage.applied_part): log index u64, part u32.
META_APPLIED_PART = b"m:applied_part"
META_LTS = b"m:lts"
META_NEXT_NODE = b"m:next_node"
META_RESTORING = b"m:restoring"
GENERATION_PREFIX = b"g:"
CHANGES_PREFIX = b"v:"
TRIE_PREFIX = b"t:"
PRESENCE_PREFIX = b"p:"
DEDUP_PREFIX = b"d:"
DEDUP_EXPIRY_PREFIX = b"e:"
META_DEDUP_PRUNED = b"m:dedup_pruned"
CLIENT_PREFIX = b"c:"
NODE_CLIENT_PREFIX = b"n:"
SUBSCRIPTION_PREFIX = b"s:"
POSITION_PREFIX = b"a:"
RETAINED_PREFIX = b"r:"
RETAINED_EXPIRY_PREFIX = b"x:"
SESSION_EXPIRY_PREFIX = b"y:"
MESSAGE_EXPIRY_PREFIX = b"z:"
MESSAGE_EXPIRY_KEY_LEN = 2 + 4 + 8 + 4 + 8
QUEUE_ACK_PREFIX = b"q:"
QUEUE_FLOOR_PREFIX = b"f:"
SHARE_MEMBER_PREFIX = b"h:"
DELIVERY_PREFIX = b"w:"
DELIVERED_PREFIX = b"o:"

MAX_INDEXED_LEVELS = 16

DATA_TAG = b"D"
INDEX_TAG = b"I"
DATA_KEY_LEN = 1 + 4 + 8
INDEX_PREFIX_LEN = 1 + 4 + 1 + 8

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_STREAM_TS = struct.Struct(">IQ")
_MAX_U64 = (1 << 64) - 1
_MAX_U32 = (1 << 32) - 1
_TWO_U32 = struct.Struct(">II")


def u16(value: int) -> bytes:
    return _U16.pack(value)


def u32(value: int) -> bytes:
    return _U32.pack(value)


def u64(value: int) -> bytes:
    return _U64.pack(value)


def read_u16(raw: bytes) -> int:
    return int(_U16.unpack(raw)[0])


def read_u32(raw: bytes) -> int:
    return int(_U32.unpack(raw)[0])


def read_u64(raw: bytes) -> int:
    return int(_U64.unpack(raw)[0])


def generation_cf(generation: int) -> str:
    """The column family that holds one generation's messages."""
    return f"gen-{generation:08d}"


def parse_generation_cf(name: str) -> int | None:
    """The generation number of a column family name, or None for others."""
    if name.startswith("gen-") and name[4:].isdigit():
        return int(name[4:])
    return None


def generation_key(generation: int) -> bytes:
    return GENERATION_PREFIX + u32(generation)


def changes_key(generation: int) -> bytes:
    """The key of a generation's change count (delete and retention steps that removed some of its keys)."""
    return CHANGES_PREFIX + u32(generation)


def trie_edge_key(parent: int, token: str) -> bytes:
    return TRIE_PREFIX + u32(parent) + token.encode("utf-8")


def parse_trie_edge_key(key: bytes) -> tuple[int, str]:
    return read_u32(key[2:6]), key[6:].decode("utf-8")


def presence_key(generation: int, stream: int) -> bytes:
    return PRESENCE_PREFIX + _TWO_U32.pack(generation, stream)


def parse_presence_key(key: bytes) -> tuple[int, int]:
    generation, stream = _TWO_U32.unpack(key[2:10])
    return int(generation), int(stream)


def data_prefix(stream: int) -> bytes:
    """The common prefix of all data keys of a stream."""
    return DATA_TAG + u32(stream)


def data_key(stream: int, timestamp_us: int) -> bytes:
    return DATA_TAG + _STREAM_TS.pack(stream, timestamp_us)


def data_key_ts(key: bytes) -> int:
    """The timestamp of a data key."""
    return int.from_bytes(key[5:DATA_KEY_LEN], "big")


def data_upper_bound(stream: int, limit: int) -> bytes:
    """The first key after the stream's data keys up to timestamp ``limit`` (an iterator's exclusive bound)."""
    if limit < _MAX_U64:
        return data_key(stream, limit + 1)
    if stream < _MAX_U32:
        return data_prefix(stream + 1)
    return bytes([DATA_TAG[0] + 1])


def parse_data_key(key: bytes) -> tuple[int, int]:
    stream, ts = _STREAM_TS.unpack(key[1:DATA_KEY_LEN])
    return int(stream), int(ts)


def level_hash(value: str) -> bytes:
    """The 8-byte hash of a varying level's value used in index keys."""
    return hashlib.blake2b(value.encode("utf-8"), digest_size=8).digest()


def index_prefix(stream: int, level: int, value: str) -> bytes:
    """The prefix of the index keys of messages with ``value`` at varying ``level``."""
    if not 0 <= level < MAX_INDEXED_LEVELS:
        raise ValueError(f"varying level {level} is not indexed (only the first {MAX_INDEXED_LEVELS} are)")
    return INDEX_TAG + u32(stream) + bytes((level,)) + level_hash(value)


def index_key(prefix: bytes, timestamp_us: int) -> bytes:
    return prefix + u64(timestamp_us)


POSTINGS_V1 = 1
_POSTING_HEAD = struct.Struct("<BI")


def encode_postings(positions: list[int]) -> bytes:
    """The value of an index key from the positions in their batch of the messages it covers.

    ``positions`` are ascending; the key's timestamp is that of the first
    one. One position is an empty value. More are a version byte (1), the
    first position and then every position, as little-endian u32 (positions
    rather than offsets, so encoding is one C call, not a loop).
    """
    if len(positions) == 1:
        return b""
    body = array("I", positions)
    if sys.byteorder != "little":
        body.byteswap()
    return _POSTING_HEAD.pack(POSTINGS_V1, positions[0]) + body.tobytes()


def decode_postings(timestamp_us: int, value: bytes) -> list[int]:
    """The timestamps an index key with this timestamp and value stands for, ascending."""
    if not value:
        return [timestamp_us]
    version, first = _POSTING_HEAD.unpack_from(value)
    if version != POSTINGS_V1 or (len(value) - _POSTING_HEAD.size) % 4:
        raise ValueError(f"index value of {len(value)} bytes with version {version} is not a posting list")
    body = array("I")
    body.frombytes(value[_POSTING_HEAD.size :])
    if sys.byteorder != "little":
        body.byteswap()
    base = timestamp_us - first
    return [base + position for position in body]


def dedup_key(producer: bytes, sequence: int) -> bytes:
    return DEDUP_PREFIX + u16(len(producer)) + producer + u64(sequence)


def dedup_expiry_key(stored_at_us: int, dedup: bytes) -> bytes:
    """The time-index key of the ``d:`` key ``dedup``, stored at ``stored_at_us``."""
    return DEDUP_EXPIRY_PREFIX + u64(stored_at_us) + dedup[len(DEDUP_PREFIX) :]


def _sized(text: str) -> bytes:
    raw = text.encode("utf-8")
    return u16(len(raw)) + raw


def client_key(clientid: str) -> bytes:
    return CLIENT_PREFIX + clientid.encode("utf-8")


def node_clients_prefix(node: str) -> bytes:
    """The prefix of the ``n:`` keys of the clients online on ``node``; the clientid follows it."""
    return NODE_CLIENT_PREFIX + _sized(node)


def subscriptions_prefix(clientid: str) -> bytes:
    """The prefix of a client's ``s:`` keys; the topic filter follows it."""
    return SUBSCRIPTION_PREFIX + _sized(clientid)


def positions_prefix(clientid: str) -> bytes:
    """The prefix of a client's ``a:`` keys (read positions); the topic filter follows it."""
    return POSITION_PREFIX + _sized(clientid)


def share_group_prefix(group: str, topic_filter: str) -> bytes:
    """The prefix of a share group's ``h:`` keys (one per member; the member's name follows it)."""
    return SHARE_MEMBER_PREFIX + _sized(group) + _sized(topic_filter)


def position_key(clientid: str, topic_filter: str) -> bytes:
    return positions_prefix(clientid) + topic_filter.encode("utf-8")


def retained_key(topic: str) -> bytes:
    return RETAINED_PREFIX + topic.encode("utf-8")


def expiry_key(prefix: bytes, expires_us: int, name: str) -> bytes:
    """An expiry index entry (``x:`` retained messages by topic, ``y:`` sessions by clientid): by time, then name."""
    return prefix + u64(expires_us) + name.encode("utf-8")


def read_expiry_key(prefix: bytes, key: bytes) -> tuple[int, str]:
    """An expiry index entry's time and name."""
    start = len(prefix)
    return read_u64(key[start : start + 8]), key[start + 8 :].decode("utf-8")


_MESSAGE_EXPIRY = struct.Struct(">IQIQ")


def message_expiry_key(generation: int, expires_us: int, stream: int, timestamp_us: int) -> bytes:
    """A stored message's entry in its generation's expiry index: by generation, then the time it expires."""
    return MESSAGE_EXPIRY_PREFIX + _MESSAGE_EXPIRY.pack(generation, expires_us, stream, timestamp_us)


def read_message_expiry_key(key: bytes) -> tuple[int, int, int, int]:
    """A ``z:`` key's (generation, expires at, stream, timestamp)."""
    generation, expires_us, stream, timestamp_us = _MESSAGE_EXPIRY.unpack_from(key, len(MESSAGE_EXPIRY_PREFIX))
    return generation, expires_us, stream, timestamp_us


def message_expiry_prefix(generation: int) -> bytes:
    """The ``z:`` keys of one generation's messages."""
    return MESSAGE_EXPIRY_PREFIX + u32(generation)


def queue_ack_key(timestamp_us: int) -> bytes:
    return QUEUE_ACK_PREFIX + u64(timestamp_us)


def queue_floor_key(topic_filter: str) -> bytes:
    return QUEUE_FLOOR_PREFIX + topic_filter.encode("utf-8")


def consumer_id(clientid: str, topic_filter: str) -> bytes:
    """A consumer of ``Deliver`` (a clientid, or ``$share/<group>``, and a filter) as its keys name it."""
    return _sized(clientid) + _sized(topic_filter)


def deliveries_prefix(consumer: bytes) -> bytes:
    """The prefix of a consumer's ``w:`` keys (its deliveries waiting for an ack); the message's u64 timestamp
    follows it."""
    return DELIVERY_PREFIX + consumer


def delivered_key(consumer: bytes) -> bytes:
    return DELIVERED_PREFIX + consumer


@dataclass(frozen=True)
class DedupRecord:
    """What a shard answered a (producer, sequence) batch: u64 first timestamp, u32 count, u64 stored at."""

    first_ts: int
    count: int
    stored_at_us: int

    _FORMAT = struct.Struct(">QIQ")

    def encode(self) -> bytes:
        return self._FORMAT.pack(self.first_ts, self.count, self.stored_at_us)

    @classmethod
    def decode(cls, raw: bytes) -> DedupRecord:
        return cls(*cls._FORMAT.unpack(raw))


@dataclass(frozen=True)
class GenerationRecord:
    """A generation's interval (messages with since_us <= timestamp < until_us) and what was stored before it.

    ``last_before_us`` is the timestamp of the last message the shard had
    stored when the generation opened (0: none), kept so that once the
    generations before it are dropped, what they held can still be told
    (``ordered.dropped_after``); None in a record written before it was kept
    (version 1). Encoded as u8 version, u64 since, u64 until (0 while open),
    u64 created_at, and in version 2 u64 last_before; a record without
    ``last_before_us`` is written as version 1, so a record read from an
    older database is written back as it was.
    """

    since_us: int
    until_us: int | None
    created_at_us: int
    last_before_us: int | None = None

    _V1 = struct.Struct(">BQQQ")
    _V2 = struct.Struct(">BQQQQ")
    SIZES = (_V1.size, _V2.size)
    """The lengths an encoded record may have (version 1, version 2)."""

    def encode(self) -> bytes:
        if self.last_before_us is None:
            return self._V1.pack(1, self.since_us, self.until_us or 0, self.created_at_us)
        return self._V2.pack(
            GENERATION_RECORD_VERSION, self.since_us, self.until_us or 0, self.created_at_us, self.last_before_us
        )

    @classmethod
    def decode(cls, raw: bytes) -> GenerationRecord:
        version = raw[0] if raw else None
        if version not in (1, GENERATION_RECORD_VERSION):
            raise ValueError(f"generation record version {version} is not supported (expected 1 or 2)")
        layout = cls._V1 if version == 1 else cls._V2
        if len(raw) != layout.size:
            raise ValueError(f"a generation record of version {version} is {layout.size} bytes, not {len(raw)}")
        if version == 1:
            _, since, until, created = layout.unpack(raw)
            return cls(since_us=since, until_us=until or None, created_at_us=created)
        _, since, until, created, last_before = layout.unpack(raw)
        return cls(since_us=since, until_us=until or None, created_at_us=created, last_before_us=last_before)

"""A node's answers as one Arrow record batch of the source's columns (all of them, or those a schema names).

Two ways to the same rows:

- **From the answers' bytes** (the client's C extension,
  :mod:`mqds.client.core.wire_columns`): every column is built in one pass of C
  code over the serialized answers, straight into Arrow's buffers; no
  protobuf parse, no Python object per message. The C code checks strings
  as UTF-8 as protobuf does, so no damaged string is passed on.
- **From protobuf messages** (batches that are not whole answers, or no C
  extension): one C-level pass over the parsed messages per column, as
  Python lists, then into Arrow.

Either way the timestamps, the vnode and the generation of a schema that
names only those are built without reading any message.

A message that does not parse (damaged bytes; a node stores only messages
that parse) is no row: both ways leave it out and count it, and the record
batch is built from the others, with a warning in the executor's log. A
schema of only the timestamps, vnode and generation reads no message, so
its rows include such a message (as a count by Spark's CSV source counts
malformed lines).
"""

from __future__ import annotations

import itertools
import logging
import struct
import sys
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any

import pyarrow as pa

from mqds.client import MessageBatch
from mqds.client.core import wire_columns as wc

log = logging.getLogger(__name__)

_WITHOUT_MESSAGES = frozenset({"timestamp", "shard", "generation"})
"""Columns built without reading the messages (the packed timestamps, the slice's vnode and generation)."""

_WANT = {
    "topic": wc.WANT_TOPIC,
    "payload": wc.WANT_PAYLOAD,
    "sender": wc.WANT_SENDER,
    "qos": wc.WANT_QOS,
    "retain": wc.WANT_RETAIN,
    "properties": wc.WANT_PROPERTIES,
    "timestamp": wc.WANT_TIMESTAMP,
}


def to_record_batch(batches: Sequence[MessageBatch], shard: int, generation: int, schema: pa.Schema) -> pa.RecordBatch:
    """Messages of one or more batches as one Arrow record batch of ``schema``: :data:`mqds.spark.SCHEMA` or part of it.

    Only the columns ``schema`` names are built. Properties become a map; a
    property name that repeats keeps its first place and its last value.
    """
    content = any(field.name not in _WITHOUT_MESSAGES for field in schema)
    answers = [batch.answer for batch in batches]
    if content and wc.native is not None and all(answer is not None for answer in answers):
        column, n, skipped = _from_answers(answers, sum(map(len, batches)), schema)  # type: ignore[arg-type]
    elif content:
        column, n, skipped = _from_messages(batches)
    else:
        column, n, skipped = {}, sum(map(len, batches)), 0
    if skipped:
        log.warning(
            "mqds: vnode %d generation %d: left out %d messages that do not parse (damaged)", shard, generation, skipped
        )
    column["shard"] = lambda t: pa.array(itertools.repeat(shard, n), t, size=n)
    column["generation"] = lambda t: pa.array(itertools.repeat(generation, n), t, size=n)
    if "timestamp" not in column:
        stamps = b"".join(map(_packed_times, batches))
        column["timestamp"] = lambda t: pa.Array.from_buffers(t, n, [None, pa.py_buffer(stamps)])
    return pa.RecordBatch.from_arrays([column[field.name](field.type) for field in schema], schema=schema)


Builders = dict[str, Callable[[pa.DataType], pa.Array]]


def _from_answers(answers: list[bytes], count: int, schema: pa.Schema) -> tuple[Builders, int, int]:
    """The columns ``schema`` names (but the vnode and generation), read by C code from the answers' bytes
    (``count`` messages); the rows, and the messages that are not rows (they do not parse)."""
    want = 0
    for field in schema:
        want |= _WANT.get(field.name, 0)
    cols = wc.columns(answers, want)
    n = cols.n
    if n + cols.skipped != count:
        raise ValueError(f"the answers hold {n + cols.skipped} messages, their batches {count}")
    buf = pa.py_buffer

    def strings(t: pa.DataType, count: int, offsets: bytes | None, data: bytes | None) -> pa.Array:
        # No validation pass: the C code checked every string as UTF-8 (a message with one that is not
        # is no row), and built the offsets itself.
        return pa.Array.from_buffers(t, count, [None, buf(offsets), buf(data)])

    def properties(t: pa.DataType) -> pa.Array:
        offsets = pa.Array.from_buffers(pa.int32(), n + 1, [None, buf(cols.property_offsets)])
        entries = offsets[n].as_py() if n else 0
        keys = strings(pa.string(), entries, cols.key_offsets, cols.key_data)
        values = strings(pa.string(), entries, cols.value_offsets, cols.value_data)
        return pa.MapArray.from_arrays(offsets, keys, values, type=t)

    builders: Builders = {
        "topic": lambda t: strings(t, n, cols.topic_offsets, cols.topic_data),
        "payload": lambda t: strings(t, n, cols.payload_offsets, cols.payload_data),
        "sender": lambda t: strings(t, n, cols.sender_offsets, cols.sender_data),
        "qos": lambda t: pa.Array.from_buffers(t, n, [None, buf(cols.qos)]),
        "retain": lambda t: pa.Array.from_buffers(t, n, [None, buf(cols.retain)]),
        "properties": properties,
        "timestamp": lambda t: pa.Array.from_buffers(t, n, [None, buf(cols.timestamps)]),
    }
    return builders, n, cols.skipped


def _from_messages(batches: Sequence[MessageBatch]) -> tuple[Builders, int, int]:
    """The content columns from the batches' protobuf messages: one C-level pass over them per column; the
    rows, and the messages left out because they do not parse."""
    items: list[Any] = []
    for batch in batches:
        items.extend(batch.wire)  # parses an answer kept as bytes: then its skipped is known
    n = len(items)
    messages = MessageBatch(items)
    builders: Builders = {
        "topic": lambda t: pa.array(messages.topics(), t),
        "payload": lambda t: pa.array(messages.payloads(), t),
        "sender": lambda t: pa.array(messages.senders(), t),
        "qos": lambda t: pa.array(messages.qos(), t),
        "retain": lambda t: pa.array(messages.retain(), t),
        "properties": lambda t: _properties_column(items, n, t),
    }
    return builders, n, sum(batch.skipped for batch in batches)


def _properties_column(items: Sequence[Any], n: int, map_type: pa.DataType) -> pa.Array:
    """The messages' user properties as one Arrow map array (a name that repeats keeps its last value).

    Most messages have none: their lengths are counted by C code, and a
    batch without any gets an array of empty maps from offsets alone.
    """
    props = list(map(attrgetter("properties"), items))
    lengths = list(map(len, props))
    if not any(lengths):
        offsets = pa.array(itertools.repeat(0, n + 1), pa.int32(), size=n + 1)
        empty = pa.array([], pa.string())
        return pa.MapArray.from_arrays(offsets, empty, empty, type=map_type)
    pairs = [list({q.key: q.value for q in p}.items()) if size else [] for p, size in zip(props, lengths, strict=True)]
    return pa.array(pairs, map_type)


def _packed_times(batch: MessageBatch) -> bytes:
    """The batch's timestamps as 8-byte little-endian integers (Arrow's layout on little-endian machines)."""
    times = batch.times
    if isinstance(times, memoryview) and sys.byteorder == "little":
        return times.tobytes()
    return struct.pack(f"<{len(times)}q", *times)

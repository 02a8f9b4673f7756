"""A node's answers as one Arrow record batch of the source's columns (all of them, or those a schema names).

Two ways to the same rows:

- **From the answers' bytes** (the client's C extension,
  :mod:`mqds.client.wire_columns`): every column is built in one pass of C
  code over the serialized answers, straight into Arrow's buffers; no
  protobuf parse, no Python object per message. Strings are then validated
  as UTF-8 by pyarrow, so a damaged answer is refused rather than passed on.
- **From protobuf messages** (batches that are not whole answers, or no C
  extension): one C-level pass over the parsed messages per column, as
  Python lists, then into Arrow.

Either way the timestamps, the vnode and the generation of a schema that
names only those are built without reading any message.
"""

from __future__ import annotations

import itertools
import struct
import sys
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any

import pyarrow as pa

from mqds.client import MessageBatch
from mqds.client import wire_columns as wc

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
    n = sum(map(len, batches))
    content = any(field.name not in _WITHOUT_MESSAGES for field in schema)
    answers = [batch.answer for batch in batches]
    if content and wc.native is not None and all(answer is not None for answer in answers):
        column = _from_answers(answers, n, schema)  # type: ignore[arg-type]  # checked just above
    elif content:
        column = _from_messages(batches, n)
    else:
        column = {}
    column["shard"] = lambda t: pa.array(itertools.repeat(shard, n), t, size=n)
    column["generation"] = lambda t: pa.array(itertools.repeat(generation, n), t, size=n)
    if "timestamp" not in column:
        stamps = b"".join(map(_packed_times, batches))
        column["timestamp"] = lambda t: pa.Array.from_buffers(t, n, [None, pa.py_buffer(stamps)])
    return pa.RecordBatch.from_arrays([column[field.name](field.type) for field in schema], schema=schema)


Builders = dict[str, Callable[[pa.DataType], pa.Array]]


def _from_answers(answers: list[bytes], n: int, schema: pa.Schema) -> Builders:
    """The columns ``schema`` names (but the vnode and generation), read by C code from the answers' bytes."""
    want = 0
    for field in schema:
        want |= _WANT.get(field.name, 0)
    cols = wc.columns(answers, want)
    if cols.n != n:
        raise ValueError(f"the answers hold {cols.n} messages, their batches {n}")
    buf = pa.py_buffer

    def strings(t: pa.DataType, count: int, offsets: bytes | None, data: bytes | None, check: bool) -> pa.Array:
        array = pa.Array.from_buffers(t, count, [None, buf(offsets), buf(data)])
        if check:
            array.validate(full=True)  # UTF-8: the C code copies bytes as they came
        return array

    def properties(t: pa.DataType) -> pa.Array:
        offsets = pa.Array.from_buffers(pa.int32(), n + 1, [None, buf(cols.property_offsets)])
        entries = offsets[n].as_py() if n else 0
        keys = strings(pa.string(), entries, cols.key_offsets, cols.key_data, True)
        values = strings(pa.string(), entries, cols.value_offsets, cols.value_data, True)
        return pa.MapArray.from_arrays(offsets, keys, values, type=t)

    return {
        "topic": lambda t: strings(t, n, cols.topic_offsets, cols.topic_data, True),
        "payload": lambda t: strings(t, n, cols.payload_offsets, cols.payload_data, False),
        "sender": lambda t: strings(t, n, cols.sender_offsets, cols.sender_data, True),
        "qos": lambda t: pa.Array.from_buffers(t, n, [None, buf(cols.qos)]),
        "retain": lambda t: pa.Array.from_buffers(t, n, [None, buf(cols.retain)]),
        "properties": properties,
        "timestamp": lambda t: pa.Array.from_buffers(t, n, [None, buf(cols.timestamps)]),
    }


def _from_messages(batches: Sequence[MessageBatch], n: int) -> Builders:
    """The content columns from the batches' protobuf messages: one C-level pass over them per column."""
    items: list[Any] = []
    for batch in batches:
        items.extend(batch.wire)
    messages = MessageBatch(items)
    return {
        "topic": lambda t: pa.array(messages.topics(), t),
        "payload": lambda t: pa.array(messages.payloads(), t),
        "sender": lambda t: pa.array(messages.senders(), t),
        "qos": lambda t: pa.array(messages.qos(), t),
        "retain": lambda t: pa.array(messages.retain(), t),
        "properties": lambda t: _properties_column(items, n, t),
    }


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

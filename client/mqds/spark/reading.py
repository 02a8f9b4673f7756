"""Reading a slice on an executor: messages through the client, as Arrow record batches.

Each read goes to any replica that has applied up to the slice's fence
(``stale_ok`` with ``fence_us``), so a killed leader costs a retry on the next
replica, not the task, and a retried task returns the same rows. Rows are
built column by column into Arrow record batches, which Spark takes without
converting Python objects one by one.
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from operator import attrgetter
from typing import Any, TypeVar

import pyarrow as pa

from mqds.client import Client, ConnectionSettings, MessageBatch, NextResult, Stream
from mqds.client import Iterator as StreamIterator
from mqds.client.errors import GenerationDroppedError, NotFoundError
from mqds.protocol.errors import Reason
from mqds.spark.plan import Slice, loss_error

log = logging.getLogger(__name__)

T = TypeVar("T")

# Rows per Arrow record batch handed to Spark.
ARROW_ROWS = 8192

_clients: dict[tuple[int, tuple[str, ...], ConnectionSettings], Client] = {}
_clients_lock = threading.Lock()


def client_for(endpoints: tuple[str, ...], settings: ConnectionSettings) -> Client:
    """One client per process and cluster: Python workers are reused across tasks, and so are its connections.

    Keyed by the process id too, so a forked process never shares its
    parent's gRPC channels.
    """
    key = (os.getpid(), endpoints, settings)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = Client(list(endpoints), settings=settings)
        return client


def any_replica_then_leader(call: Callable[[bool], T]) -> T:
    """Run ``call(stale_ok=True)``; if the replica that answered does not know the stream yet, ask the leader.

    A replica far behind may not have learned a stream or generation the
    leader listed at planning; the leader always has, and with the fence it
    returns the same rows.
    """
    try:
        return call(True)
    except NotFoundError as err:
        if err.reason not in (Reason.UNKNOWN_STREAM, Reason.UNKNOWN_GENERATION):
            raise
        return call(False)


def _stream_batches(client: Client, part: Slice, stream: Stream, batch_size: int) -> Iterator[MessageBatch]:
    def make(stale_ok: bool) -> StreamIterator:
        return client.make_iterator(stream, part.topic_filter, part.start_us, stale_ok=stale_ok)

    iterator = any_replica_then_leader(make)
    while True:
        position = iterator

        def next_batch(stale_ok: bool, position: StreamIterator = position) -> NextResult:
            return client.next(position, batch_size, stale_ok=stale_ok, fence_us=part.fence_us)

        result = any_replica_then_leader(next_batch)
        if result.messages:
            yield result.messages
        if result.end_of_stream:
            return
        iterator = result.iterator


def first_timestamp(client: Client, part: Slice) -> int | None:
    """The timestamp of the slice's first matching message (None: it has none), reading one message per stream.

    Planning asks this of slices it cuts by time, so the cuts spread over
    where messages are rather than over the generation's whole span.
    """
    first: int | None = None
    for stream in part.streams:
        try:
            batch = next(_stream_batches(client, part, stream, 1), None)
        except GenerationDroppedError:
            return part.start_us  # the read itself reports (or skips) the loss
        if batch:
            stamp = batch[0].timestamp_us or part.start_us
            first = stamp if first is None else min(first, stamp)
    return first


def read_slice(client: Client, part: Slice, batch_size: int, fail_on_data_loss: bool) -> Iterator[MessageBatch]:
    """The slice's messages, stream by stream, in batches as the nodes return them.

    A generation dropped while the read runs raises :class:`DataLossError`,
    or (``fail_on_data_loss`` false) ends the slice with what was read.
    """
    for stream in part.streams:
        try:
            yield from _stream_batches(client, part, stream, batch_size)
        except GenerationDroppedError as err:
            what = f"vnode {part.shard} generation {part.generation}"
            if fail_on_data_loss:
                raise loss_error([what], "a generation was dropped while the read ran") from err
            log.warning("mqds: %s was dropped while it was read; skipping the rest of it", what)
            return


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


_WITHOUT_MESSAGES = frozenset({"timestamp", "shard", "generation"})
"""Columns built without reading the messages (the packed timestamps, the slice's vnode and generation)."""


def to_record_batch(batches: Sequence[MessageBatch], shard: int, generation: int, schema: pa.Schema) -> pa.RecordBatch:
    """Messages of one or more batches as one Arrow record batch of ``schema``: :data:`mqds.spark.SCHEMA` or part of it.

    Built column by column with the batch's column methods (one C-level
    pass over the protobuf messages each, no ``Message`` object per row),
    only the columns ``schema`` names; the timestamps are the node's packed
    field itself (``MessageBatch.times``), not read message by message.
    Properties become a map; a property name that repeats keeps its last
    value. A schema of only ``timestamp``, ``shard`` and ``generation``
    touches no message at all.
    """
    items: list[Any] = []
    stamps = bytearray()
    content = any(field.name not in _WITHOUT_MESSAGES for field in schema)
    n = 0
    for batch in batches:
        if content:
            items.extend(batch.wire)
        stamps += _packed_times(batch)
        n += len(batch)
    messages = MessageBatch(items)
    column: dict[str, Callable[[pa.DataType], pa.Array]] = {
        "topic": lambda t: pa.array(messages.topics(), t),
        "payload": lambda t: pa.array(messages.payloads(), t),
        "sender": lambda t: pa.array(messages.senders(), t),
        "qos": lambda t: pa.array(messages.qos(), t),
        "retain": lambda t: pa.array(messages.retain(), t),
        "properties": lambda t: _properties_column(items, n, t),
        "timestamp": lambda t: pa.Array.from_buffers(t, n, [None, pa.py_buffer(stamps)]),
        "shard": lambda t: pa.array(itertools.repeat(shard, n), t, size=n),
        "generation": lambda t: pa.array(itertools.repeat(generation, n), t, size=n),
    }
    return pa.RecordBatch.from_arrays([column[field.name](field.type) for field in schema], schema=schema)


def _packed_times(batch: MessageBatch) -> bytes:
    """The batch's timestamps as 8-byte little-endian integers (Arrow's layout on little-endian machines)."""
    times = batch.times
    if isinstance(times, memoryview) and sys.byteorder == "little":
        return times.tobytes()
    return struct.pack(f"<{len(times)}q", *times)


def record_batches(
    client: Client, part: Slice, batch_size: int, fail_on_data_loss: bool, schema: pa.Schema
) -> Iterator[pa.RecordBatch]:
    """The slice as Arrow record batches of at least :data:`ARROW_ROWS` rows (the last one may have fewer).

    A batch the node sent is converted whole; smaller ones (a stream's
    last) are gathered until they make :data:`ARROW_ROWS` rows.
    """
    pending: list[MessageBatch] = []
    rows = 0
    for messages in read_slice(client, part, batch_size, fail_on_data_loss):
        pending.append(messages)
        rows += len(messages)
        if rows >= ARROW_ROWS:
            yield to_record_batch(pending, part.shard, part.generation, schema)
            pending, rows = [], 0
    if pending:
        yield to_record_batch(pending, part.shard, part.generation, schema)

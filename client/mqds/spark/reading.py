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
import threading
from collections.abc import Callable, Iterator
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


def to_record_batch(messages: MessageBatch, shard: int, generation: int, schema: pa.Schema) -> pa.RecordBatch:
    """Messages as one Arrow record batch of ``schema`` (the source's schema, see :data:`mqds.spark.SCHEMA`).

    Built column by column from the batch's protobuf messages, with no
    ``Message`` object per row. Properties become a map; a property name
    that repeats keeps its last value.
    """
    n = len(messages)
    types = [f.type for f in schema]
    columns = [
        pa.array(messages.topics(), types[0]),
        pa.array(messages.payloads(), types[1]),
        pa.array(messages.senders(), types[2]),
        pa.array(messages.qos(), types[3]),
        pa.array(messages.retain(), types[4]),
        pa.array([list(dict(p).items()) if p else [] for p in messages.properties()], types[5]),
        pa.array(messages.timestamps(), types[6]),
        pa.array(itertools.repeat(shard, n), types[7], size=n),
        pa.array(itertools.repeat(generation, n), types[8], size=n),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def record_batches(
    client: Client, part: Slice, batch_size: int, fail_on_data_loss: bool, schema: pa.Schema
) -> Iterator[pa.RecordBatch]:
    """The slice as Arrow record batches of about :data:`ARROW_ROWS` rows."""
    pending: list[Any] = []  # protobuf messages, as the nodes sent them
    for messages in read_slice(client, part, batch_size, fail_on_data_loss):
        pending.extend(messages.wire)
        if len(pending) >= ARROW_ROWS:
            yield to_record_batch(MessageBatch(pending), part.shard, part.generation, schema)
            pending = []
    if pending:
        yield to_record_batch(MessageBatch(pending), part.shard, part.generation, schema)

"""Reading a slice on an executor: messages through the client, as Arrow record batches.

Each read goes to any replica that has applied up to the slice's fence
(``stale_ok`` with ``fence_us``), so a killed leader costs a retry on the next
replica, not the task, and a retried task returns the same rows. Rows are
built column by column into Arrow record batches (:mod:`mqds.spark.columns`,
from the answers' bytes), which Spark takes without converting Python
objects one by one.

The Python worker is tuned once per process (:func:`settle_worker`): PySpark
runs a full collection of the worker's heap after every task, which walks
the 50,000 objects that its imports (pyarrow, gRPC, protobuf) leave behind;
they are frozen out of the collector's reach, as the node freezes its own.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import pyarrow as pa

from mqds.client import Client, ConnectionSettings, MessageBatch, NextResult, Stream
from mqds.client import Iterator as StreamIterator
from mqds.client.core.rank_read import RankCalls
from mqds.client.errors import GenerationDroppedError, NotFoundError
from mqds.protocol.errors import Reason
from mqds.spark.columns import to_record_batch
from mqds.spark.plan import Slice, loss_error

log = logging.getLogger(__name__)

T = TypeVar("T")

# Rows per Arrow record batch handed to Spark, unless its answers make ARROW_BYTES first.
ARROW_ROWS = 8192
ARROW_BYTES = 64 << 20

_clients: dict[tuple[int, tuple[str, ...], ConnectionSettings], Client] = {}
_clients_lock = threading.Lock()
_settled: set[int] = set()
"""The process ids :func:`settle_worker` has run in."""


def settle_worker() -> None:
    """Once per process: collect, then freeze every object that exists now out of the cyclic collector's reach.

    A reused PySpark worker runs ``gc.collect()`` after each task, and a full
    pass walks every tracked object: the 50,000 or so that pyarrow, gRPC,
    protobuf and pyspark leave in the worker cost 20-30 ms of CPU a task on
    the 2-core machine, about a quarter of the worker's CPU in a count
    (docs/spark.md). Those objects live as long as the process; what a
    task makes later is still collected. Objects are freed by their reference
    counts as before, frozen or not.
    """
    pid = os.getpid()
    with _clients_lock:
        if pid in _settled:
            return
        _settled.add(pid)
    gc.collect()
    gc.freeze()


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


def _stream_batches(client: Client, part: Slice, streams: Sequence[Stream], batch_size: int) -> Iterator[MessageBatch]:
    """``streams`` (of the slice), read stream after stream: each call goes on into the next streams once one is
    read to the fence (``first_batch`` with ``then``), so a slice of many short streams costs a call or two."""
    calls = RankCalls(streams)
    while (call := calls.next_call()) is not None:

        def first(stale_ok: bool, start: Stream = call[0], then: Sequence[Stream] = call[1]) -> NextResult:
            return client.first_batch(
                start,
                part.topic_filter,
                part.start_us,
                batch_size,
                stale_ok=stale_ok,
                fence_us=part.fence_us,
                then=then,
            )

        result = any_replica_then_leader(first)
        if result.messages:
            yield result.messages
        calls.answered(result)
        while not result.end_of_stream:  # stopped inside a stream: on with it alone

            def next_batch(stale_ok: bool, position: StreamIterator = result.iterator) -> NextResult:
                return client.next(position, batch_size, stale_ok=stale_ok, fence_us=part.fence_us)

            result = any_replica_then_leader(next_batch)
            if result.messages:
                yield result.messages


def first_timestamp(client: Client, part: Slice) -> int | None:
    """The timestamp of the slice's first matching message (None: it has none), reading one message per stream.

    Planning asks this of slices it cuts by time, so the cuts spread over
    where messages are rather than over the generation's whole span.
    """
    first: int | None = None
    for stream in part.streams:
        try:
            batch = next(_stream_batches(client, part, [stream], 1), None)
        except GenerationDroppedError:
            return part.start_us  # the read itself reports (or skips) the loss
        if batch:
            stamp = batch[0].timestamp_us or part.start_us
            first = stamp if first is None else min(first, stamp)
    return first


def read_slice(client: Client, part: Slice, batch_size: int, fail_on_data_loss: bool) -> Iterator[MessageBatch]:
    """The slice's messages, stream by stream (several streams to a batch when they are short), in batches as the
    nodes return them.

    A generation dropped while the read runs raises :class:`DataLossError`,
    or (``fail_on_data_loss`` false) ends the slice with what was read.
    """
    try:
        yield from _stream_batches(client, part, part.streams, batch_size)
    except GenerationDroppedError as err:
        what = f"vnode {part.shard} generation {part.generation}"
        if fail_on_data_loss:
            raise loss_error([what], "a generation was dropped while the read ran") from err
        log.warning("mqds: %s was dropped while it was read; skipping the rest of it", what)


def record_batches(
    client: Client, part: Slice, batch_size: int, fail_on_data_loss: bool, schema: pa.Schema
) -> Iterator[pa.RecordBatch]:
    """The slice as Arrow record batches of at least :data:`ARROW_ROWS` rows or :data:`ARROW_BYTES` bytes
    (the last one may be smaller).

    A batch the node sent is converted whole; smaller ones (a stream's
    last) are gathered until they make :data:`ARROW_ROWS` rows, or answers
    of :data:`ARROW_BYTES` (large messages: a column's offsets are 32-bit).
    """
    pending: list[MessageBatch] = []
    rows = nbytes = 0
    for messages in read_slice(client, part, batch_size, fail_on_data_loss):
        pending.append(messages)
        rows += len(messages)
        nbytes += messages.nbytes
        if rows >= ARROW_ROWS or nbytes >= ARROW_BYTES:
            yield to_record_batch(pending, part.shard, part.generation, schema)
            pending, rows, nbytes = [], 0, 0
    if pending:
        yield to_record_batch(pending, part.shard, part.generation, schema)

"""The streaming reader of the ``mqds`` source: micro-batches between per-vnode positions.

An offset is a JSON object mapping each vnode number to a timestamp, in
microseconds: the last position the query has read up to in that vnode,
``{"0": 1762000000123456, "1": ...}``. A micro-batch from offset ``start`` to
``end`` reads, per vnode, the messages with ``start < timestamp <= end``.
Every ``end`` is at most the vnode's fence when it was planned, so reading it
again (a retried task, a query restarted from its checkpoint) returns the
same messages from any replica: nothing is lost or read twice across
restarts. ``maxMessagesPerTrigger`` cuts each vnode's range at the timestamp
of the last message that fits, found by reading ahead on the driver.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow

from mqds.client import Client, Fence, NextResult, Stream
from mqds.client import Iterator as StreamIterator
from mqds.client.core.operations import replay_order
from mqds.client.errors import GenerationDroppedError
from mqds.spark.batch import SlicePartition, read_partition
from mqds.spark.options import EARLIEST, LATEST, SourceOptions
from mqds.spark.plan import data_loss, dropped_ranges, loss_error, pack_slices, plan_slices
from mqds.spark.reading import any_replica_then_leader, client_for, first_timestamp

log = logging.getLogger(__name__)

Offset = dict[str, int]


def earliest_position(fence: Fence) -> int:
    """The position before a vnode's oldest message still stored (retention may have dropped older ones)."""
    first = min(fence.generations, key=lambda g: g.generation, default=None)
    if first is None or first.generation == 1 or first.since_us == 0:
        return 0
    return first.since_us - 1


def positions(offset: Mapping[str, object]) -> dict[int, int]:
    """An offset as {vnode: timestamp}; ValueError for anything that is not one."""
    out: dict[int, int] = {}
    for key, value in offset.items():
        if not str(key).isdigit() or isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"not an mqds offset: {dict(offset)!r} (expected {{vnode: timestamp_us}})")
        out[int(key)] = value
    return out


def as_offset(by_vnode: Mapping[int, int]) -> Offset:
    return {str(shard): by_vnode[shard] for shard in sorted(by_vnode)}


class MqdsStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches of the messages matching the topic filter, vnode by vnode (see the module docstring)."""

    def __init__(self, options: SourceOptions, arrow_schema: pa.Schema) -> None:
        self.options = options
        self.arrow_schema = arrow_schema
        self._turn = 0
        self._target: dict[int, int] | None = None

    def _client(self) -> Client:
        return client_for(self.options.endpoints, self.options.settings)

    def _fences(self) -> dict[int, Fence]:
        return {f.shard: f for f in self._client().get_fences()}

    def initialOffset(self) -> Offset:
        starting = self.options.starting_offsets
        out: dict[int, int] = {}
        for shard, fence in self._fences().items():
            position = starting.for_vnode(shard)
            if position == LATEST:
                position = fence.timestamp_us
            elif position == EARLIEST:
                position = earliest_position(fence)
            out[shard] = position
        return as_offset(out)

    def getDefaultReadLimit(self) -> ReadLimit:
        limit = self.options.max_messages_per_trigger
        return ReadAllAvailable() if limit is None else ReadMaxRows(limit)

    def prepareForTriggerAvailableNow(self) -> None:
        """Trigger.AvailableNow: stop at the fences of now, whatever is written later."""
        self._target = {shard: f.timestamp_us for shard, f in self._fences().items()}

    def latestOffset(self, start: Offset, limit: ReadLimit) -> Offset:
        fences = self._fences()
        begin = positions(start)
        latest: dict[int, int] = {}
        for shard, fence in fences.items():
            top = fence.timestamp_us
            if self._target is not None:
                top = min(top, self._target.get(shard, top))
            latest[shard] = max(begin.get(shard, earliest_position(fence)), top)
        for shard, position in begin.items():
            latest.setdefault(shard, position)
        if isinstance(limit, ReadMaxRows):
            latest = self._cap(begin, latest, limit.max_rows)
        return as_offset(latest)

    def _cap(self, begin: dict[int, int], latest: dict[int, int], budget: int) -> dict[int, int]:
        """Move each vnode's end back so the micro-batch holds at most ``budget`` messages in all.

        The budget is shared out vnode by vnode, what one vnode leaves
        unused passing on to the next; the vnode that goes first rotates
        from one trigger to the next, so a small budget starves no vnode.
        """
        pending = [shard for shard in sorted(latest) if latest[shard] > begin.get(shard, 0)]
        if not pending:
            return latest
        turn = self._turn % len(pending)
        self._turn += 1
        order = pending[turn:] + pending[:turn]
        out = dict(latest)
        remaining = budget
        for i, shard in enumerate(order):
            share = -(-remaining // (len(order) - i))
            if share <= 0:
                out[shard] = begin.get(shard, 0)
                continue
            out[shard], used = self._cut(shard, begin.get(shard, 0), latest[shard], share)
            remaining -= used
        return out

    def _cut(self, shard: int, after_us: int, upto_us: int, count: int) -> tuple[int, int]:
        """The position after the first ``count`` matching messages of ``shard`` in ``(after_us, upto_us]``.

        Returns that position and how many messages it covers (fewer than
        ``count`` when the range holds fewer; the position is ``upto_us`` then).
        """
        client = self._client()
        topic_filter = self.options.topic_filter
        taken = 0
        for streams in replay_order(client.get_streams(topic_filter, after_us + 1, shards=[shard])):
            need = count - taken
            stamps: list[int] = []
            for stream in streams:
                try:
                    stamps += self._first_timestamps(client, stream, after_us + 1, upto_us, need)
                except GenerationDroppedError:
                    continue  # partitions() reports the loss
            stamps.sort()
            if len(stamps) >= need:
                return stamps[need - 1], count
            taken += len(stamps)
        return upto_us, taken

    def _first_timestamps(self, client: Client, stream: Stream, lo_us: int, hi_us: int, count: int) -> list[int]:
        def make(stale_ok: bool) -> StreamIterator:
            return client.make_iterator(stream, self.options.topic_filter, lo_us, stale_ok=stale_ok)

        iterator = any_replica_then_leader(make)
        stamps: list[int] = []
        while len(stamps) < count:
            size = min(count - len(stamps), self.options.batch_size)

            def next_batch(stale_ok: bool, position: StreamIterator = iterator, size: int = size) -> NextResult:
                return client.next(position, size, stale_ok=stale_ok, fence_us=hi_us)

            result = any_replica_then_leader(next_batch)
            stamps += result.messages.timestamps()
            if result.end_of_stream:
                break
            iterator = result.iterator
        return stamps

    def partitions(self, start: Offset, end: Offset) -> Sequence[InputPartition]:
        begin, finish = positions(start), positions(end)
        ranges = {shard: (begin.get(shard, 0) + 1, top) for shard, top in finish.items() if top > begin.get(shard, 0)}
        if not ranges:
            return []
        client = self._client()
        fences = self._fences()
        lost: list[str] = []
        for shard, (lo, hi) in ranges.items():
            if shard in fences:
                lost += data_loss(shard, lo, hi, dropped_ranges(fences[shard].generations))
        if lost:
            if self.options.fail_on_data_loss:
                raise loss_error(lost, "the query had not read them when retention dropped them")
            log.warning("mqds: skipping dropped generations: %s", "; ".join(lost))
        streams = client.get_streams(
            self.options.topic_filter, min(lo for lo, _ in ranges.values()), shards=sorted(ranges)
        )
        slices = plan_slices(
            ranges,
            fences,
            streams,
            self.options.topic_filter,
            self.options.max_records_per_partition,
            first_timestamp=lambda part: first_timestamp(client, part),
        )
        # A micro-batch of a few messages over many vnodes runs as one task, not one per vnode.
        return [SlicePartition(group) for group in pack_slices(slices)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(self.options, partition, self.arrow_schema)

    def commit(self, end: Offset) -> None:
        """Nothing to release: the nodes keep no per-query state (retention alone decides what stays)."""

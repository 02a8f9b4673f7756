"""The batch reader of the ``mqds`` source: plan a snapshot's slices on the driver, read them on the executors.

Planning asks every vnode's leader for its fence (or takes the fences of a
snapshot token), lists the streams that may match the topic filter, and
makes one Spark partition per (vnode, generation), cut by time when RocksDB's
key estimate says it is larger than ``maxRecordsPerPartition``. Each
partition then reads up to its fence from any replica that has applied that
far. The topic filter and the time window go to the nodes with every request,
so only matching messages cross the network.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSourceReader,
    EqualNullSafe,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    LessThan,
    LessThanOrEqual,
    StringStartsWith,
)

from mqds.protocol.sharding import shard_of
from mqds.spark.options import OptionError, SourceOptions, intersect_filters, prefix_as_filter, topic_as_filter
from mqds.spark.plan import Slice, data_loss, dropped_ranges, loss_error, plan_slices
from mqds.spark.reading import client_for, first_timestamp, record_batches, settle_worker
from mqds.spark.snapshot import Snapshot

log = logging.getLogger(__name__)

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


class SlicePartition(InputPartition):
    """A Spark input partition carrying :class:`~mqds.spark.plan.Slice` s, read one after the other."""

    def __init__(self, parts: tuple[Slice, ...]) -> None:
        super().__init__(parts)


def read_partition(options: SourceOptions, partition: InputPartition, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """What a task runs, for batch and streaming reads alike.

    A read with nothing to plan still gets one task from Spark, with the
    value None: it returns no rows. The worker's heap is frozen at its first
    task (:func:`~mqds.spark.reading.settle_worker`).
    """
    settle_worker()
    parts: tuple[Slice, ...] | None = partition.value
    if parts is None:
        return
    client = client_for(options.endpoints, options.settings)
    for part in parts:
        yield from record_batches(client, part, options.batch_size, options.fail_on_data_loss, schema)


class MqdsBatchReader(DataSourceReader):
    """Reads one consistent snapshot of the messages matching the options (see the module docstring)."""

    def __init__(self, options: SourceOptions, arrow_schema: pa.Schema) -> None:
        self.options = options
        self.arrow_schema = arrow_schema
        self.topic_filter: str | None = options.topic_filter
        """The server-side filter; None once pushed filters leave nothing to match."""
        self.start_us = options.start_us
        self.end_us = options.end_us
        self.shards: set[int] | None = None
        self.generations: set[int] | None = None
        self.senders: set[str] | None = None

    def partitions(self) -> Sequence[InputPartition]:
        if self.topic_filter is None or (self.end_us is not None and self.end_us <= self.start_us):
            return []
        client = client_for(self.options.endpoints, self.options.settings)
        current = {f.shard: f for f in client.get_fences()}
        pinned = self.options.snapshot
        snapshot = pinned or Snapshot.from_fences(current.values(), 0)
        selected = self._selected_shards(len(current))
        ranges: dict[int, tuple[int, int]] = {}
        lost: list[str] = []
        for vnode in snapshot.vnodes:
            fence = current.get(vnode.shard)
            if fence is None:
                raise OptionError(
                    f"option snapshot: the token names vnode {vnode.shard}, which this cluster does not have "
                    f"({len(current)} vnodes): it comes from another cluster"
                )
            if vnode.fence_us > fence.timestamp_us:
                raise OptionError(
                    f"option snapshot: the token's fence of vnode {vnode.shard} is ahead of the vnode itself: "
                    "it comes from another cluster"
                )
            if not vnode.fence_us or (selected is not None and vnode.shard not in selected):
                continue
            lo = self.start_us
            hi = vnode.fence_us if self.end_us is None else min(vnode.fence_us, self.end_us - 1)
            if lo > hi:
                continue
            ranges[vnode.shard] = (lo, hi)
            if pinned is not None:
                lost += data_loss(vnode.shard, lo, hi, dropped_ranges(fence.generations, vnode.generations))
        if lost:
            if self.options.fail_on_data_loss:
                raise loss_error(lost, "generations the snapshot covers were dropped")
            log.warning("mqds: skipping dropped generations the snapshot covers: %s", "; ".join(lost))
        if not ranges:
            return []
        streams = client.get_streams(self.topic_filter, self.start_us, shards=sorted(ranges))
        slices = plan_slices(
            ranges,
            current,
            streams,
            self.topic_filter,
            self.options.max_records_per_partition,
            self.generations,
            lambda part: first_timestamp(client, part),
        )
        return [SlicePartition((s,)) for s in slices]

    def _selected_shards(self, n_shards: int) -> set[int] | None:
        chosen = None if self.shards is None else set(self.shards)
        if self.senders is not None:
            of_senders = {shard_of(sender, n_shards) for sender in self.senders}
            chosen = of_senders if chosen is None else chosen & of_senders
        return chosen

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(self.options, partition, self.arrow_schema)


def _timestamp_us(value: Any) -> int | None:
    """A pushed-down timestamp literal as microseconds since the epoch (naive values are UTC), else None."""
    if isinstance(value, datetime.datetime):
        when = value if value.tzinfo is not None else value.replace(tzinfo=datetime.UTC)
        return (when - _EPOCH) // datetime.timedelta(microseconds=1)
    return None


def _ints(value: Any) -> set[int] | None:
    values = value if isinstance(value, tuple | list) else (value,)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return set(values)
    return None


class MqdsPushdownReader(MqdsBatchReader):
    """The batch reader that also takes filters Spark pushes down (``spark.sql.python.filterPushdown.enabled``).

    Handled on the nodes: ``topic = 'x'`` (the topic as the filter),
    ``timestamp`` comparisons (the time window), ``shard`` and ``generation``
    equality and ``IN`` (which slices to plan). Narrowed, then checked again
    by Spark: ``topic LIKE 'a/b%'`` (the whole levels of the prefix become
    ``a/#``) and ``sender = 'x'`` / ``IN`` (only the senders' vnodes are read).
    """

    def pushFilters(self, filters: list[Filter]) -> list[Filter]:
        return [f for f in filters if not self._push(f)]

    def _push(self, f: Filter) -> bool:
        """Apply ``f`` to the plan; True when the read now returns only rows that satisfy it."""
        column = f.attribute if hasattr(f, "attribute") else ()
        if column == ("topic",):
            return self._push_topic(f)
        if column == ("timestamp",):
            return self._push_time(f)
        if column in (("shard",), ("generation",)) and isinstance(f, EqualTo | EqualNullSafe | In):
            values = _ints(f.value)
            if values is None:
                return False
            if column == ("shard",):
                self.shards = values if self.shards is None else self.shards & values
            else:
                self.generations = values if self.generations is None else self.generations & values
            return True
        if column == ("sender",) and isinstance(f, EqualTo | EqualNullSafe | In):
            values_raw = f.value if isinstance(f, In) else (f.value,)
            if all(isinstance(v, str) for v in values_raw):
                senders = set(values_raw)
                self.senders = senders if self.senders is None else self.senders & senders
            return False  # other senders share those vnodes: Spark still filters
        return False

    def _narrow(self, other: str | None) -> None:
        if self.topic_filter is not None:
            self.topic_filter = None if other is None else intersect_filters(self.topic_filter, other)

    def _push_topic(self, f: Filter) -> bool:
        if isinstance(f, EqualTo | EqualNullSafe) and isinstance(f.value, str):
            self._narrow(topic_as_filter(f.value))
            return True
        if isinstance(f, StringStartsWith) and isinstance(f.value, str):
            narrowed = prefix_as_filter(f.value)
            if narrowed is not None:
                self._narrow(narrowed)
        return False

    def _push_time(self, f: Filter) -> bool:
        value = getattr(f, "value", None)
        us = _timestamp_us(value)
        if us is None:
            return False
        if isinstance(f, GreaterThan):
            self.start_us = max(self.start_us, us + 1)
        elif isinstance(f, GreaterThanOrEqual):
            self.start_us = max(self.start_us, us)
        elif isinstance(f, LessThan):
            self.end_us = us if self.end_us is None else min(self.end_us, us)
        elif isinstance(f, LessThanOrEqual):
            self.end_us = us + 1 if self.end_us is None else min(self.end_us, us + 1)
        elif isinstance(f, EqualTo | EqualNullSafe):
            self.start_us = max(self.start_us, us)
            self.end_us = us + 1 if self.end_us is None else min(self.end_us, us + 1)
        else:
            return False
        return True

"""Streaming reads against a real 3-node cluster: per-vnode offsets, read limits, restarts from a checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.streaming.datasource import ReadAllAvailable

from mqds.client import Client, Message
from mqds.spark import FORMAT, arrow_schema
from mqds.spark.options import parse_options
from mqds.spark.plan import DataLossError
from mqds.spark.stream import MqdsStreamReader
from mqds.tools.local_cluster import LocalCluster

pytestmark = [pytest.mark.spark, pytest.mark.integration]


def publish(cluster: LocalCluster, prefix: str, count: int, first: int = 0) -> list[Message]:
    batch = [
        Message(f"{prefix}/dev/{i % 6}/v", f"{i}".encode(), sender=f"{prefix}-s{i % 9}", qos=1)
        for i in range(first, first + count)
    ]
    with Client(cluster.addresses, timeout_s=30) as client:
        return client.store_batch(batch)


def reader(endpoints: str, prefix: str, **options: str) -> MqdsStreamReader:
    given = {"endpoints": endpoints, "topicFilter": f"{prefix}/#", **options}
    return MqdsStreamReader(parse_options(given, streaming=True), arrow_schema())


def read_between(source: MqdsStreamReader, start: dict[str, int], end: dict[str, int]) -> list[tuple[int, int]]:
    """What a micro-batch from ``start`` to ``end`` returns, read as the executors would: positions."""
    out: list[tuple[int, int]] = []
    for partition in source.partitions(start, end):
        for batch in source.read(partition):
            stamps = batch.column("timestamp").cast(pa.int64()).to_pylist()
            out += zip(batch.column("shard").to_pylist(), stamps, strict=True)
    return sorted(out)


def test_a_stream_stopped_and_restarted_from_its_checkpoint_loses_and_repeats_nothing(
    spark: SparkSession, cluster: LocalCluster, endpoints: str, prefix: str, tmp_path: Path
) -> None:
    stored = publish(cluster, prefix, 300)
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"

    def start(**trigger: Any) -> StreamingQuery:
        stream = (
            spark.readStream.format(FORMAT)
            .option("endpoints", endpoints)
            .option("topicFilter", f"{prefix}/#")
            .option("startingOffsets", "earliest")
            .option("maxMessagesPerTrigger", "100")
            .load()
        )
        return (
            stream.select("shard", F.expr("unix_micros(timestamp)").alias("ts"), "payload")
            .writeStream.format("parquet")
            .option("path", str(out))
            .option("checkpointLocation", str(checkpoint))
            .trigger(**trigger)
            .start()
        )

    # Stopped from outside as soon as one micro-batch is done: the next may be cut in the middle.
    query = start(processingTime="0 seconds")
    deadline = time.monotonic() + 90
    while not [p for p in query.recentProgress if p["numInputRows"]] and time.monotonic() < deadline:
        time.sleep(0.1)
    query.stop()
    first_run = [p for p in query.recentProgress if p["numInputRows"]]
    assert first_run and all(p["numInputRows"] <= 100 for p in first_run)
    offset = json.loads(first_run[0]["sources"][0]["endOffset"])
    assert set(offset) == {str(s) for s in range(4)} and all(isinstance(v, int) for v in offset.values())

    more = publish(cluster, prefix, 150, first=300)
    query = start(availableNow=True)
    query.awaitTermination(120)
    assert query.exception() is None
    assert all(p["numInputRows"] <= 100 for p in query.recentProgress)
    written = sorted((r.shard, r.ts) for r in spark.read.parquet(str(out)).select("shard", "ts").collect())
    assert written == sorted((m.shard, m.timestamp_us) for m in stored + more)


def test_offsets_are_vnode_positions_and_each_trigger_respects_its_limit(
    cluster: LocalCluster, endpoints: str, prefix: str
) -> None:
    before = publish(cluster, prefix, 80)
    source = reader(endpoints, prefix, startingOffsets="latest", maxMessagesPerTrigger="25")
    latest = source.initialOffset()
    with Client(cluster.addresses) as client:
        assert latest == {str(f.shard): f.timestamp_us for f in client.get_fences()}
    assert source.latestOffset(latest, ReadAllAvailable()) == latest  # nothing new: no micro-batch

    after = publish(cluster, prefix, 70, first=80)
    start, seen, sizes = latest, [], []
    while (end := source.latestOffset(start, source.getDefaultReadLimit())) != start:
        batch = read_between(source, start, end)
        sizes.append(len(batch))
        seen += batch
        start = end
    assert sorted(seen) == sorted((m.shard, m.timestamp_us) for m in after)  # latest: only what came after the start
    assert max(sizes) <= 25 and sum(sizes) == 70

    # Earliest reads everything; JSON starts each named vnode after the position it gives.
    everything = reader(endpoints, prefix, startingOffsets="earliest")
    assert read_between(everything, everything.initialOffset(), end) == sorted(
        (m.shard, m.timestamp_us) for m in before + after
    )
    shard = before[0].shard or 0
    cut = sorted(m.timestamp_us or 0 for m in before + after if m.shard == shard)[9]
    named = reader(endpoints, prefix, startingOffsets=json.dumps({str(shard): cut}))
    initial = named.initialOffset()
    assert initial[str(shard)] == cut
    assert read_between(named, initial, end) == sorted(
        (m.shard, m.timestamp_us) for m in before + after if m.shard != shard or (m.timestamp_us or 0) > cut
    )


def test_a_stream_behind_a_dropped_generation_fails_or_skips(
    cluster: LocalCluster, endpoints: str, prefix: str
) -> None:
    stored = publish(cluster, prefix, 40)
    shard = stored[0].shard or 0
    source = reader(endpoints, prefix, startingOffsets="earliest")
    start = source.initialOffset()
    with cluster.admin_client() as client:  # generations are admin calls
        current = next(g.generation for g in client.list_generations(shard) if g.current)
        client.add_generation(shard)
        client.drop_generation(shard, current)
    end = source.latestOffset(start, ReadAllAvailable())
    with pytest.raises(DataLossError, match=f"vnode {shard} generation {current}"):
        source.partitions(start, end)
    lenient = reader(endpoints, prefix, startingOffsets="earliest", failOnDataLoss="false")
    assert read_between(lenient, start, end) == sorted((m.shard, m.timestamp_us) for m in stored if m.shard != shard)

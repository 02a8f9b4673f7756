"""Batch reads through Spark (local[2]) against a real 3-node cluster: what was written comes back, exactly."""

from __future__ import annotations

import collections
import datetime
import re
import threading
import time

import pytest
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from spark_support import load, positions, rows_of, stored_rows

from mqds.client import Client, Message
from mqds.spark import arrow_schema, pin_snapshot
from mqds.spark.batch import MqdsBatchReader
from mqds.spark.options import parse_options
from mqds.spark.plan import DataLossError
from mqds.tools.local_cluster import LocalCluster

pytestmark = [pytest.mark.spark, pytest.mark.integration]


def publish(cluster: LocalCluster, messages: list[Message]) -> list[Message]:
    with Client(cluster.addresses, timeout_s=30) as client:
        return client.store_batch(messages)


def readings(prefix: str, count: int, senders: int = 6) -> list[Message]:
    """Numbered readings of several devices: temp and hum topics, every QoS, some retained, some with properties."""
    return [
        Message(
            topic=f"{prefix}/sensor/{i % 5}/{'temp' if i % 2 else 'hum'}",
            payload=f"reading {i}".encode(),
            sender=f"{prefix}-dev-{i % senders}",
            qos=i % 3,
            retain=i % 7 == 0,
            properties=[("unit", "C"), ("seq", str(i)), ("unit", "K")] if i % 4 == 0 else (),
        )
        for i in range(count)
    ]


def utc(timestamp_us: int) -> datetime.datetime:
    """A timestamp as an aware datetime, exactly (no float rounding)."""
    return datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(microseconds=timestamp_us)


def generation_now(cluster: LocalCluster) -> dict[int, int]:
    with Client(cluster.addresses) as client:
        return {g.shard: g.generation for g in client.list_generations() if g.current}


def test_a_schema_of_some_columns_reads_just_those(
    spark: SparkSession, cluster: LocalCluster, endpoints: str, prefix: str
) -> None:
    stored = publish(cluster, readings(prefix, 120))
    # Spark prunes no columns for a Python source: the reader is told which ones in the schema.
    some = (
        spark.read.format("mqds")
        .schema("shard int, timestamp timestamp, properties map<string,string>, sender string")
        .option("endpoints", endpoints)
        .option("topicFilter", f"{prefix}/#")
        .load()
    )
    assert some.columns == ["shard", "timestamp", "properties", "sender"]
    got = sorted(
        (r[0], r[1], r[2], r[3])
        for r in some.select("shard", F.expr("unix_micros(timestamp)"), "properties", "sender").collect()
    )
    assert got == sorted((m.shard, m.timestamp_us, dict(m.properties), m.sender) for m in stored)
    assert some.count() == len(stored)
    for bad, why in [
        ("shard int, colour string", "'colour' is not one of its columns"),
        ("shard long", "'shard' is int, not bigint"),
        ("shard int, shard int", "'shard' named twice"),
    ]:
        with pytest.raises(PySparkException, match=re.escape(why)):
            spark.read.format("mqds").schema(bad).option("endpoints", endpoints).load().count()


def test_a_read_returns_exactly_what_was_written_with_filters_and_windows(
    spark: SparkSession, cluster: LocalCluster, endpoints: str, prefix: str
) -> None:
    first = publish(cluster, readings(prefix, 300))
    time.sleep(0.05)
    second = publish(cluster, readings(prefix, 200)[::-1])
    stored = first + second
    generation = generation_now(cluster)
    assert len(set(generation.values())) == 1
    gen = next(iter(generation.values()))

    everything = load(spark, endpoints, topicFilter=f"{prefix}/#")
    assert everything.schema.simpleString().startswith("struct<topic:string,payload:binary,sender:string,qos:int")
    # Every column of every message, properties as a map where a repeated name keeps its last value.
    assert rows_of(everything) == stored_rows(stored, gen)
    assert {"unit": "K", "seq": "0"} in [row[7] for row in rows_of(everything)]

    temps = load(spark, endpoints, topicFilter=f"{prefix}/sensor/+/temp")
    assert rows_of(temps) == stored_rows([m for m in stored if m.topic.endswith("/temp")], gen)
    one = load(spark, endpoints, topicFilter=f"{prefix}/sensor/3/#")
    assert rows_of(one) == stored_rows([m for m in stored if m.topic.startswith(f"{prefix}/sensor/3/")], gen)

    # The window [startTime, endTime) is the second batch, by timestamp.
    start = min(m.timestamp_us or 0 for m in second)
    end = max(m.timestamp_us or 0 for m in second) + 1
    window = load(spark, endpoints, topicFilter=f"{prefix}/#", startTime=str(start), endTime=str(end))
    in_window = [m for m in stored if start <= (m.timestamp_us or 0) < end]
    assert rows_of(window) == stored_rows(in_window, gen)
    iso = utc(start).isoformat().replace("+00:00", "Z")
    assert positions(load(spark, endpoints, topicFilter=f"{prefix}/#", startTime=iso)) == sorted(
        (m.shard, m.timestamp_us) for m in stored if (m.timestamp_us or 0) >= start
    )

    # One partition per vnode with data; smaller ones when asked for, still the same rows.
    vnodes = len({m.shard for m in stored})
    assert everything.rdd.getNumPartitions() == vnodes
    split = load(spark, endpoints, topicFilter=f"{prefix}/#", maxRecordsPerPartition="60")
    assert split.rdd.getNumPartitions() > vnodes
    assert rows_of(split) == rows_of(everything)
    per_partition = split.groupBy(F.spark_partition_id().alias("p")).count().collect()
    assert max(r["count"] for r in per_partition) < max(collections.Counter(m.shard for m in stored).values())


def test_filters_on_topic_and_time_are_pushed_to_the_nodes(
    spark: SparkSession, cluster: LocalCluster, endpoints: str, prefix: str
) -> None:
    stored = publish(cluster, readings(prefix, 240))
    df = load(spark, endpoints, topicFilter=f"{prefix}/#")

    def filtered_by_spark(frame: DataFrame) -> bool:
        """Whether Spark's physical plan still filters the rows the source returns."""
        return re.search(r"\bFilter\b", frame._jdf.queryExecution().executedPlan().toString()) is not None

    exact = df.where(F.col("topic") == f"{prefix}/sensor/2/temp")
    assert not filtered_by_spark(exact)  # the nodes filtered: Spark does not need to
    assert positions(exact) == sorted((m.shard, m.timestamp_us) for m in stored if m.topic == f"{prefix}/sensor/2/temp")

    stamps = sorted(m.timestamp_us or 0 for m in stored)
    lo, hi = stamps[60], stamps[180]
    ranged = df.where((F.col("timestamp") >= utc(lo)) & (F.col("timestamp") < utc(hi)))
    assert not filtered_by_spark(ranged)
    assert positions(ranged) == sorted((m.shard, m.timestamp_us) for m in stored if lo <= (m.timestamp_us or 0) < hi)

    prefixed = df.where(F.col("topic").startswith(f"{prefix}/sensor/1"))
    assert filtered_by_spark(prefixed)  # narrowed to whole levels on the nodes, the rest checked by Spark
    assert positions(prefixed) == sorted(
        (m.shard, m.timestamp_us) for m in stored if m.topic.startswith(f"{prefix}/sensor/1")
    )

    shard = stored[0].shard
    by_shard = df.where(F.col("shard") == shard)
    assert by_shard.rdd.getNumPartitions() == 1
    assert positions(by_shard) == sorted((m.shard, m.timestamp_us) for m in stored if m.shard == shard)
    sender = stored[0].sender
    assert positions(df.where(F.col("sender") == sender)) == sorted(
        (m.shard, m.timestamp_us) for m in stored if m.sender == sender
    )
    assert df.where(F.col("topic") == "elsewhere/x").count() == 0


def test_a_snapshot_token_reads_the_same_rows_while_writers_keep_writing(
    spark: SparkSession, cluster: LocalCluster, endpoints: str, prefix: str
) -> None:
    publish(cluster, readings(prefix, 200))
    stop = threading.Event()
    written: list[Message] = []

    def writer() -> None:
        with Client(cluster.addresses, timeout_s=30) as client:
            n = 0
            while not stop.is_set():
                written.extend(client.store_batch(readings(f"{prefix}", 20, senders=4)[n % 3 :: 3]))
                n += 1
                time.sleep(0.02)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        time.sleep(0.3)
        # Taken before pinning: a write acknowledged while the pin is asking
        # the other shards for their fences may be after its own shard's fence.
        before = list(written)
        token = pin_snapshot(endpoints)
        first = positions(load(spark, endpoints, topicFilter=f"{prefix}/#", snapshot=token))
        time.sleep(0.3)
        again = positions(load(spark, endpoints, topicFilter=f"{prefix}/#", snapshot=token))
        fresh = positions(load(spark, endpoints, topicFilter=f"{prefix}/#"))
    finally:
        stop.set()
        thread.join(10)
    assert first == again
    assert set(first) >= {(m.shard, m.timestamp_us) for m in before}  # acknowledged before the pin: in it
    assert len(fresh) > len(first) and set(fresh) >= set(first)  # a read without a token pins a newer snapshot


def test_a_read_survives_the_leader_of_a_vnode_being_killed(
    spark: SparkSession, cluster: LocalCluster, endpoints: str, prefix: str
) -> None:
    stored = publish(cluster, readings(prefix, 3000, senders=8))
    shard = stored[0].shard or 0
    victim = cluster.leader(shard) or cluster.wait_for_leader(shard)
    # Small pages make the read long enough to be cut in the middle.
    df = load(spark, endpoints, topicFilter=f"{prefix}/#", batchSize="25")
    result: list[list[tuple[int, int]]] = []
    failure: list[BaseException] = []

    def read() -> None:
        try:
            result.append(positions(df))
        except BaseException as err:
            failure.append(err)

    thread = threading.Thread(target=read)
    thread.start()
    tracker = spark.sparkContext.statusTracker()
    deadline = time.monotonic() + 60
    while not tracker.getActiveStageIds() and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    killed_while_reading = thread.is_alive()
    cluster.kill(victim)
    try:
        thread.join(120)
        assert not failure, failure
        assert killed_while_reading, "the read ended before the kill; make it longer"
        assert result[0] == sorted((m.shard, m.timestamp_us) for m in stored)
    finally:
        cluster.start_node(victim, timeout_s=60)
        cluster.wait_ready(60)


def test_a_dropped_generation_fails_the_read_or_is_skipped(
    spark: SparkSession, cluster: LocalCluster, endpoints: str, prefix: str
) -> None:
    stored = publish(cluster, readings(prefix, 120, senders=8))
    token = pin_snapshot(endpoints)
    victim_shard = stored[0].shard or 0
    with cluster.admin_client() as client:  # generations are admin calls
        old = {g.shard: g.generation for g in client.list_generations() if g.current}
        client.add_generation()
        # Planned before the drop, read after it: the executor meets GENERATION_DROPPED.
        reader = MqdsBatchReader(
            parse_options({"endpoints": endpoints, "topicFilter": f"{prefix}/#", "snapshot": token}), arrow_schema()
        )
        planned = [p for p in reader.partitions() if p.value[0].shard == victim_shard]
        client.drop_generation(victim_shard, old[victim_shard])
    # Followers apply the drop a moment after the leader; reads may go to any of them.
    deadline = time.monotonic() + 15
    while True:
        try:
            list(reader.read(planned[0]))
        except DataLossError as err:
            assert "failOnDataLoss" in str(err) and f"vnode {victim_shard}" in str(err)
            break
        assert time.monotonic() < deadline, "the dropped generation was still read"
        time.sleep(0.2)
    # Every replica has applied the drop now: whichever one a read goes to (reads spread over
    # them), the lenient read meets the drop at its first call and returns nothing.
    cluster.assert_replicas_identical(timeout_s=30, shards=[victim_shard])
    lenient = MqdsBatchReader(
        parse_options({"endpoints": endpoints, "topicFilter": f"{prefix}/#", "failOnDataLoss": "false"}),
        arrow_schema(),
    )
    assert list(lenient.read(planned[0])) == []

    # Through Spark: the snapshot covers the dropped generation, so planning refuses...
    with pytest.raises(PySparkException) as refused:
        load(spark, endpoints, topicFilter=f"{prefix}/#", snapshot=token).count()
    assert f"vnode {victim_shard} generation {old[victim_shard]}" in str(refused.value)
    assert "failOnDataLoss" in str(refused.value)
    # ...or, with failOnDataLoss=false, reads what is left.
    left = load(spark, endpoints, topicFilter=f"{prefix}/#", snapshot=token, failOnDataLoss="false")
    assert positions(left) == sorted((m.shard, m.timestamp_us) for m in stored if m.shard != victim_shard)


def test_bad_options_fail_at_load_with_the_reason(spark: SparkSession, endpoints: str) -> None:
    with pytest.raises(PySparkException) as err:
        load(spark, endpoints, startTime="2026-11-02", endTime="2026-11-01")
    assert "option endTime" in str(err.value) and "must be after startTime" in str(err.value)
    with pytest.raises(PySparkException) as err:
        spark.read.format("mqds").option("endpoints", "nohost").load()
    assert "option endpoints: endpoint 'nohost' is not host:port" in str(err.value)
